algorithm demo
  "A formula test."
  define searched
    eps = first_of(0.2, batch_mean(where(abs(rho - 1) > eps, 1, 0)) <= 0.1)
    w = clamp(rho, 1 - eps, 1 + eps)
  end
  trust_region  searched
