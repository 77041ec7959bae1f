algorithm cycle_a extends cycle_b
  kl            none
