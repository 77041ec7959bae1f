algorithm demo
  "A formula test."
  define gate
    w = where(A > 0 and rho > 1, 1.2, rho)
  end
  trust_region  gate
