algorithm demo
  "A formula test."
  define searched
    eps = first_of([0.1, 0.2, 0.3], abs(rho - 1) <= eps)
    w = clamp(rho, 1 - eps, 1 + eps)
  end
  trust_region  searched
