algorithm three_errors
  "Three independent mistakes: all are reported."
  baseline      group_mena
  trust_region  clip(low=1.5, high=0.28)
  normalizer    group_std
  kl            k3(where=loss)
