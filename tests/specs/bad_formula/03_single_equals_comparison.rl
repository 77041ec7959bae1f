algorithm demo
  "A formula test."
  define gate
    w = where(A = 0, 1, rho)
  end
  trust_region  gate
