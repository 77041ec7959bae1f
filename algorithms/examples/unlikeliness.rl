# Unlikeliness reward (He, Fried, Welleck 2025, "Rewarding the Unlikely: Lifting GRPO Beyond
# Distribution Sharpening", arXiv 2506.02355; code github.com/AndreHe02/rewarding-unlikely-release,
# verl/trainer/ppo/ray_lean_trainer.py _compute_advantages): before GRPO's standardisation, each
# reward is scaled by 1 - penalty * rank / G, where rank orders the group's answers by their mean
# old log-probability per token (0 = the least likely), so of two right answers the less likely
# one keeps more of its reward. penalty 0.25 as the authors' examples/lean/grpo.sh; the loss is
# their verl's: PPO clip 0.2 on the unclamped ratio, low-variance KL (0.1, value clamped to
# +-10) in the loss, token mean, no entropy bonus.
algorithm unlikeliness extends grpo
  "GRPO on rewards scaled down for the group's most likely answers (rank by mean old log-prob)."
  define unlikeliness_rank
    penalty = 0.25
    eps = 1e-6
    rank = group_rank(seq_mean(old_logp))            # 0 = the least likely answer of its group
    s = r * (1 - rank / G * penalty)
    A = (s - group_mean(s)) / (group_std(s) + eps)
  end
  define low_var_kl
    beta = 0.1
    x = ref_logp - logp
    kl = clamp(exp(x) - x - 1, -10, 10)
  end
  baseline      unlikeliness_rank
  normalizer    none
  ratio         token(clamp=1000)
  kl            low_var_kl
  aggregation   token_mean
