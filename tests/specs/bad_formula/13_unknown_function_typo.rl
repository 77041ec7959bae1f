algorithm demo
  "A formula test."
  define gate
    w = sigmod(rho - 1) * 4
  end
  trust_region  gate
