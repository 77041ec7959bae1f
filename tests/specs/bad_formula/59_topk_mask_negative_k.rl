algorithm demo
  "A formula test."
  define keep_k
    k = -1
    keep = group_topk_mask(r, k)
  end
  filter  keep_k
