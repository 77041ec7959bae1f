algorithm demo
  "A formula test."
  define gate
    weights = mask
    count = L
  end
  aggregation  gate
