algorithm demo
  "A formula test."
  define gate
    l = -A * logp
  end
  objective  gate
  trust_region  clip
