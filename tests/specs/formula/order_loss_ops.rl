# Every order operation in a loss slot, for compiled == eager: sort, rank, cumsum and
# topk_mask over a sequence's tokens, a group's rows and the batch (tokens; a rank of its rows), and
# quantiles whose level is an expression of G; sort and cumsum also of values with a gradient.
algorithm order_loss_ops extends grpo
  "A trust region reading every order operation (compiled == eager)."
  define order_gate
    k = 2
    v = sg(abs(logp - old_logp))
    tok = where(seq_topk_mask(v, k), 1, 0) + seq_rank(v) / T + seq_sort(logp - old_logp) + seq_cumsum(rho) / T
    seqv = seq_mean(v)
    grp = where(group_topk_mask(seqv, G / 2), 1, 0) + group_rank(seqv) + group_sort(seqv) + group_cumsum(seqv)
    bat = where(batch_topk_mask(v, B), 1, 0) + batch_rank(seqv) / B + batch_rank(v) / (B * T) + batch_sort(rho) + batch_cumsum(logp) / (B * T)
    cap = batch_quantile(v, 1 - 1 / G) + seq_quantile(v, 1 / G) + group_quantile(seqv, (k - 1) / max(G - 1, 1))
    w = min(rho * (1 + 0.01 * (tok + grp + bat)), 1 + cap)
  end
  trust_region  order_gate
