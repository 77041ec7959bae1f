# Every order operation in a loss slot, for compiled == eager: sort, rank, cumsum and
# topk_mask over a sequence's tokens, a group's rows and the batch (rows and tokens), and
# quantiles whose level is an expression of G.
algorithm order_loss_ops extends grpo
  "A trust region reading every order operation (compiled == eager)."
  define order_gate
    k = 2
    v = sg(abs(logp - old_logp))
    tok = where(seq_topk_mask(v, k), 1, 0) + seq_rank(v) / T + seq_sort(v) + seq_cumsum(v) / T
    seqv = seq_mean(v)
    grp = where(group_topk_mask(seqv, G / 2), 1, 0) + group_rank(seqv) + group_sort(seqv) + group_cumsum(seqv)
    bat = where(batch_topk_mask(v, B), 1, 0) + batch_rank(v) / (B * T) + batch_sort(v) + batch_cumsum(v) / (B * T)
    rows = where(batch_topk_mask(seqv, k), 1, 0) + batch_rank(seqv) + batch_sort(seqv) + batch_cumsum(seqv)
    cap = batch_quantile(v, 1 - 1 / G) + seq_quantile(v, 1 / G) + group_quantile(seqv, (k - 1) / max(G - 1, 1))
    w = min(rho * (1 + 0.01 * (tok + grp + bat + rows)), 1 + cap)
  end
  trust_region  order_gate
