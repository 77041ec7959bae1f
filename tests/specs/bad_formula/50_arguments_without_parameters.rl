algorithm demo
  "A formula test."
  define gate
    w = where(A > 0, rho, 1)
  end
  trust_region  gate(high=0.3)
