algorithm demo
  "A formula test."
  define clip
    w = min(rho, 1.2)
  end
  trust_region  clip
