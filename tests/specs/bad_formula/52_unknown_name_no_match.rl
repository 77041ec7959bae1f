algorithm demo
  "A formula test."
  define gate
    x = r - mean_g
    b = x
  end
  baseline  gate
