algorithm demo
  "A formula test."
  define gate
    cap = batch_quantile(rho, 1.5)
    w = min(rho, cap)
  end
  trust_region  gate
