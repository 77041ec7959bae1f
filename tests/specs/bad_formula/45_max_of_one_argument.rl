algorithm demo
  "A formula test."
  define gate
    w = rho / max(rho)
  end
  trust_region  gate
