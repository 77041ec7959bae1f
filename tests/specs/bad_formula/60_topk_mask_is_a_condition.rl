algorithm demo
  "A formula test."
  define top_tokens
    w = rho * seq_topk_mask(abs(logp - old_logp), 3)
  end
  trust_region  top_tokens
