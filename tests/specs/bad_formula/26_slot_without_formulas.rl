algorithm demo
  "A formula test."
  define gate
    w = min(rho, 1.2)
  end
  sampling  gate
