# no description: it is inherited. clip(high=...) replaces the whole slot (low is the default again)
algorithm chain_mid extends chain_base
  trust_region  clip(high=0.3)
  kl            none
