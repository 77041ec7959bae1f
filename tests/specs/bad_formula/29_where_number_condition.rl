algorithm demo
  "A formula test."
  define gate
    w = where(A, rho, 1)
  end
  trust_region  gate
