# truncate's high only needs > -1: a negative cap (weights capped below 1) is allowed
algorithm negative_numbers
  "A negative number where the range allows one."
  baseline      group_mean
  objective     is_weighted
  trust_region  truncate(high=-0.5)
  critic        none
