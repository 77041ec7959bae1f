algorithm demo
  "A formula test."
  define gate
    w = min(rh0, 1.2)
  end
  trust_region  gate
