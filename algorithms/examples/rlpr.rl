# RLPR (Yu et al. 2025, "RLPR: Extrapolating RLVR to General Domains without Verifiers", arXiv
# 2506.18254; code github.com/OpenBMB/RLPR @ 8490fca). The reward is the policy's own probability of
# the data's reference answer: each completion is cut after its <answer> tag, the reference answer put
# in place of its own, and the policy that sampled scores it (the mean per-token probability of the
# answer's tokens: `answer_prob`, verl/workers/reward_manager/prob.py compute_scoreB,
# mean_exp_log_softmax); minus the same probability with no reasoning before it (`bare_answer_prob`,
# their scoreA), clipped at 0 (reward_manager_shaping_function_name=threshold_0), then
# 0.9 x that + 0.1 x the format reward (format_coefficient 0.1: the run's reward `r`, 1 for a
# well-formed <think>..</think><answer>..</answer> completion). GRPO advantages with the authors'
# std_filter (a group whose reward std is below 1e-6 gets A = 0), and their std-based filter: a group
# whose reward std is below `std_floor` leaves the loss (the authors move that floor by an average over
# steps, examples/RLPR/reproduce_qwen.sh, std_filter_beta 0.5; here it is a parameter: 0 keeps every
# group). Loss: verl's PPO clip 0.2 / 0.27 on the unclamped ratio, token mean, entropy bonus 0.001
# (their ppo_trainer.yaml), KL coefficient 0.
algorithm rlpr extends grpo
  "The policy's probability of the reference answer as the reward (minus it without reasoning), GRPO."
  define probability_reward
    format_coef = 0.1
    r = (1 - format_coef) * max(answer_prob - bare_answer_prob, 0) + format_coef * r
  end
  define grpo_std_filter
    eps = 1e-6
    s = group_std(r)
    A = where(s < eps, 0, (r - group_mean(r)) / (s + eps))
  end
  define reward_std_floor
    std_floor = 0.0
    keep = group_std(r) >= std_floor
  end
  shaping       probability_reward
  baseline      grpo_std_filter
  normalizer    none
  filter        reward_std_floor
  ratio         token(clamp=1000)
  trust_region  clip(low=0.2, high=0.27)
  kl            none
  aggregation   token_mean
  entropy       bonus(coef=0.001)
