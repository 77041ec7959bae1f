algorithm demo
  "A formula test."
  define gate
    a = b + 1
    b = a * 2
    w = rho * a
  end
  trust_region  gate
