# Advantage Reweighting (Yang et al. 2025, "Do Not Let Low-Probability Tokens Over-Dominate in RL
# for LLMs", arXiv 2505.12929; code github.com/zhyang2226/AR-Lopti, verl/trainer/ppo/ray_trainer.py
# compute_reweight_advantage(reweight_method="both_linear_normal")): each token's GRPO advantage
# times alpha * pi_old(o_t) + (1 - alpha), so a rare token's update is damped against a likely
# one's. alpha 0.2 (k 0.2, tau 0.8) as scripts/train_kklogic_AR_4x80GB.sh, which also sets the
# loss: clip 0.2 / 0.24 on the unclamped ratio, dual clip c = 10, token mean, low-variance KL
# 0.001 (log-ratio clamped to +-5 before exp, value to +-10), token mean. (The paper's second
# part, Lopti -- low-probability tokens updated in a separate optimizer step before the others --
# is not a loss: docs/new_algorithms.md, "Not writable".)
algorithm advantage_reweighting extends grpo
  "GRPO advantages reweighted per token by the old probability: (k pi_old + tau) A."
  define prob_reweighted_std
    eps = 1e-6
    k = 0.2
    tau = 0.8
    A = A / (group_std(r) + eps) * (k * exp(old_logp) + tau)
  end
  define low_var_kl_clamped
    beta = 0.001
    x = clamp(ref_logp - logp, -5, 5)
    kl = clamp(exp(x) - x - 1, -10, 10)
  end
  normalizer    prob_reweighted_std
  ratio         token(clamp=1000)
  trust_region  dual_clip(low=0.2, high=0.24, c=10.0)
  kl            low_var_kl_clamped
  aggregation   token_mean
