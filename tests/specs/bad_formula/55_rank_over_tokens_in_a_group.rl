algorithm demo
  "A formula test."
  define short_first
    keep = group_rank(mask * L) < 2
  end
  filter  short_first
