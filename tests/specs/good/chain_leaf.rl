algorithm chain_leaf extends chain_mid
  "Leaf of the chain."
  normalizer    none
  aggregation   token_mean
