algorithm demo
  "A formula test."
  define gate
    keep = 0 < L < 100
  end
  filter  gate
