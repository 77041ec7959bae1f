algorithm demo
  "A test spec."
  baseline      group_mean
  ppo           clip(low=0.2, high=0.28)
