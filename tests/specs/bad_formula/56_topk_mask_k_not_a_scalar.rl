algorithm demo
  "A formula test."
  define keep_k
    keep = group_topk_mask(r, L)
  end
  filter  keep_k
