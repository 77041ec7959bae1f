algorithm demo
  "A formula test."
  define gate
    b = group_mean(r)
    A = r - b
  end
  baseline  gate
