algorithm demo
  "A formula test."
  define gate
    eps = 0.1
    w = rho / (eps * 2)
  end
  trust_region  gate(eps=0)
