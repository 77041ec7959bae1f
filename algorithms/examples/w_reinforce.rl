# W-REINFORCE (Zhu, Xia, Wei, Wu, Chen, Meng 2025, "The Surprising Effectiveness of Negative
# Reinforcement in LLM Reasoning", arXiv 2506.01347; code github.com/TianHongZXY/RLVR-Decomposed,
# verl compute_psr_nsr_outcome_advantage, advantage='weighted'): REINFORCE whose positive samples
# are down-weighted -- a correct answer (reward 1) gets advantage lam = 0.1, a wrong one (reward 0)
# -1, any other reward itself; no baseline, no normalization. The authors' verl actor: PPO clip 0.2,
# token mean, entropy bonus 0.001 (their ppo_trainer.yaml), no KL.
algorithm w_reinforce extends grpo
  "Weighted REINFORCE: +lam for correct answers, -1 for wrong ones; PPO clip, token mean."
  define weighted_rewards
    lam = 0.1
    r = where(r == 1, lam * r, where(r == 0, r - 1, r))
  end
  shaping       weighted_rewards
  baseline      none
  normalizer    none
  trust_region  clip(low=0.2, high=0.2)
  kl            none
  aggregation   token_mean
  entropy       bonus(coef=0.001)
