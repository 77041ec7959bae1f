algorithm demo
  "A formula test."
  define sapo_gate
    w = sigmoid(rho - 1) * 4
  end
  trust_region  sapo_gat
