algorithm empty_parens
  "Empty parentheses mean all defaults."
  baseline      group_mean()
  normalizer    group_std( )
  objective     ppo()
  filter        zero_variance(), pass_rate_cap()
