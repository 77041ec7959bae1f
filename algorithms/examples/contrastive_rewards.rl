# Contrastive rewards (Shen et al. 2024, "Improving Reinforcement Learning from Human Feedback Using
# Contrastive Rewards", arXiv 2403.07708): each answer's reward is taken relative to the rewards of
# the reference (SFT) model's own answers to the same prompt, r(x, y) - mean_k r(x, y_ref_k), so a
# prompt the reference already solves pays little and one it fails pays much. The paper samples the
# k reference answers once, offline; a run samples them at each step (reward.reference = policy_base,
# reward.reference_samples = k): the reference's weights never change, so these are draws of the
# same distribution. The paper trains with PPO; here on REINFORCE's batch-mean baseline (a group
# baseline would cancel a per-prompt offset: the contrast must reach the advantage).
algorithm contrastive_rewards extends reinforce
  "REINFORCE on the reward minus the reference model's mean reward on the same prompt."
  define contrastive
    r = r - ref_reward
  end
  shaping       contrastive
