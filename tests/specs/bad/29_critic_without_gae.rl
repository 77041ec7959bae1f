algorithm demo
  "A test spec."
  baseline      group_mean
  critic        value(clip=0.2)
