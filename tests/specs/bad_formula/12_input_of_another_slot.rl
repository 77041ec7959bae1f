algorithm demo
  "A formula test."
  define gate
    w = rho * exp(ref_logp - logp)
  end
  trust_region  gate
