algorithm demo
  "A formula test."
  define gate
    kl = ref_logp - logp
  end
  kl  gate
