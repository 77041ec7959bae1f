# Intuitor, RL from internal feedback (Zhao, Kang, Dong, Levine, Song 2025, "Learning to Reason
# without External Rewards", arXiv 2505.19590; the authors' code github.com/sunblaze-ucb/Intuitor
# @ 3f0cdd7, verl-intuitor: verl/workers/actor/dp_actor.py _forward_micro_batch and
# verl/utils/torch_functional.py self_certainty_from_logits, verl/trainer/ppo/ray_trainer.py
# compute_advantage(INTUITOR), math_intuitor.sh). No verifier: each answer's reward is its
# self-certainty, the mean over its tokens of logsumexp(z) - mean_v z (the KL from the uniform
# distribution to the policy plus log V; z the old policy's logits divided by the sampling
# temperature, from the forward that makes the old logprobs), verl's masked mean (+1e-8 in the
# count; centred first on the batch's mean self-certainty c, a constant the group's baseline
# removes: values near log V differ by a few hundredths within a group, which float32 keeps only
# after c is taken off). Then GRPO's standardisation (eps 1e-6, Bessel std), and verl's loss as math_intuitor.sh
# sets it: PPO clip 0.2 on the log-ratio clamped at +-20 (the default ratio), dual clip c = 3,
# token mean, low-variance KL 0.005 (log-ratio clamped at +-20, value at +-10), no entropy bonus.
# The run's reward function is computed and logged but does not reach the advantage.
algorithm intuitor extends grpo
  "GRPO on the answers' self-certainty (logsumexp minus mean logit, averaged over tokens): no external reward."
  define self_certainty_reward
    c = batch_mean(self_certainty)
    r = seq_sum(self_certainty - c) / (L + 1e-8)
  end
  define low_var_kl
    beta = 0.005
    x = clamp(ref_logp - logp, -20, 20)
    kl = clamp(exp(x) - x - 1, -10, 10)
  end
  shaping       self_certainty_reward
  trust_region  dual_clip(low=0.2, high=0.2, c=3.0)
  kl            low_var_kl
  aggregation   token_mean
