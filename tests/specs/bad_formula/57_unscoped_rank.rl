algorithm demo
  "A formula test."
  define short_first
    keep = rank(L) < 2
  end
  filter  short_first
