# page onepage two
algorithm demo
  baseline      group_mena
