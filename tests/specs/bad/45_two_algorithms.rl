algorithm demo
  "A test spec."
  baseline      group_mean

algorithm other
  baseline      leave_one_out
