algorithm demo
  "A formula test."
  define bisected
    eps = bisect(0, 1, T, batch_mean(where(abs(rho - 1) > eps, 1, 0)) <= 0.1)
    w = clamp(rho, 1 - eps, 1 + eps)
  end
  trust_region  bisected
