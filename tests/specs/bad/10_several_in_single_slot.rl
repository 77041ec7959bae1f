algorithm demo
  "A test spec."
  baseline      group_mean, leave_one_out
