algorithm demo
  "A formula test."
  define gate
    b = group_mean(mask)
  end
  baseline  gate
