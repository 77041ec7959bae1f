algorithm demo
  "A formula test."
  define gate
    scale = scale * 2
    w = rho * scale
  end
  trust_region  gate
