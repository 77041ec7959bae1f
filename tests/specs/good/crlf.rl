algorithm crlf extends grpo
  "Windows line endings."

  trust_region  clip(low=0.2, high=0.28)
  filter        zero_variance, overlong
  kl            none
