algorithm demo
  "A formula test."
  define gate
    b = mask * r
  end
  baseline  gate
