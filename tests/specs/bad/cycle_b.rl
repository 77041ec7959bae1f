# helper for 34_extends_cycle: cycle_b -> cycle_a -> cycle_b
algorithm cycle_b extends cycle_a
  kl            none
