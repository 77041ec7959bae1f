# SimKO, Simple Pass@K Policy Optimization (Peng, Ren, Yu, Liu, Wen 2025, arXiv 2510.14807;
# the authors' code: github.com/CLR-Lab/SimKO, verl/trainer/ppo/core_algos.py
# compute_policy_loss_simko at f4bf432, fed by verl/workers/actor/dp_actor.py at c090978).
# It reshapes probability mass over the policy's top-K candidates. On a correct answer
# (reward 1), at a token whose entropy is above its sequence's tau-quantile, the ratio mixes in
# the top-K candidates' ratios: (1 - coef) rho + coef / K sum_k sg(rho / rho_k) rho_k, so the
# gradient lifts the K most likely tokens too; on a wrong answer (its advantages sum below 0), at
# such a token, when the sampled token was the policy's top-1, the advantage is scaled by lam
# (a stronger push down on the top-1). Then PPO's clip (0.2, unclamped log-ratio) and the token
# mean of the batch (verl's masked_mean). The authors use K = 3, coef = 0.01, tau = 0.8.
# Their update forward picks its own top-K ids and top-1; here both come from the old policy
# (topk_logp is the current policy at the old policy's top-K ids, docs/formulas.md): the same on
# an exactly on-policy update, as in tests/formula/test_policy_topk.py.
algorithm simko extends grpo
  "SimKO: top-K ratio mixing on correct answers, a stronger top-1 penalty on wrong ones, at high-entropy tokens."
  define simko_pg
    K = 3
    coef = 0.01
    tau = 0.8
    lam = 1.1
    eps = 0.2
    ratio = exp(logp - old_logp)
    high = ent > seq_quantile(ent, tau)
    mix = where(high, coef, 0)
    rk = exp(topk_logp - old_topk_logp)
    topk_sum = k_sum(sg(ratio) / (sg(rk) + 1e-8) * rk)
    mixed = where(reward == 1, (1 - mix) * ratio + mix / K * topk_sum, ratio)
    push = where(seq_sum(A) < 0, is_top1, 0) * where(high, 1, 0)
    adv = where(push > 0, lam * A, A)
    l = max(-adv * mixed, -adv * clamp(mixed, 1 - eps, 1 + eps))
  end
  objective     simko_pg
  trust_region  none
  kl            none
  aggregation   token_mean
