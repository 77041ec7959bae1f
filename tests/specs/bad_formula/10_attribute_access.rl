algorithm demo
  "A formula test."
  define gate
    w = rho.detach()
  end
  trust_region  gate
