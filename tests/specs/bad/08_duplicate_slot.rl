algorithm demo
  "A test spec."
  baseline      group_mean
  normalizer    group_std
  baseline      leave_one_out
