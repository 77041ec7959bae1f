# The k-th shortest answer of each group as a quantile whose level is an expression of G:
# with linear interpolation, level (k - 1) / (G - 1) is the k-th smallest of G values, so the
# same spec holds for every group size (no level recomputed by hand per G). Unlike
# group_topk_mask, the cut keeps every answer tied with the k-th: more than k where lengths tie.
algorithm order_quantile_of_g extends grpo
  "GRPO keeping the answers no longer than the k-th shortest of their group."
  define kth_shortest
    k = 2
    keep = L <= group_quantile(L, (k - 1) / max(G - 1, 1))
  end
  filter  kth_shortest
