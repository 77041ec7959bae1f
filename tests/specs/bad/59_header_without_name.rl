algorithm
  "The name is missing."
  baseline      group_mean
