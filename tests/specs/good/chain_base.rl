# the root of a three-file chain: chain_leaf -> chain_mid -> chain_base
algorithm chain_base
  "Base of the chain."
  baseline      group_mean
  normalizer    group_std(eps=1e-5)
  trust_region  clip(low=0.1, high=0.1)
  kl            k3(beta=0.01)
