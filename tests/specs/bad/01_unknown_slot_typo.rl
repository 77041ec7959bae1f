algorithm demo
  "A test spec."
  baselin       group_mean
