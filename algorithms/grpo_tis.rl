# GRPO with truncated importance sampling (TIS; Yao, Liu et al. 2025, "Your Efficient RL
# Framework Secretly Brings You Off-Policy RL Training", fengyao.notion.site/off-policy-rl):
# the inference engine (vLLM, bf16, other kernels) samples from pi_rollout, not from the
# trainer's pi_old, so each token's policy loss is weighted by min(pi_old / pi_rollout, C),
# C = 2 (verl's rollout_is="token", rollout_is_threshold=2.0: its decoupled_token_is preset).
algorithm grpo_tis extends grpo
  "GRPO whose per-token loss is weighted by the truncated ratio pi_old / pi_rollout (C = 2)."
  correction    importance(level=token, mode=truncate, high=2.0)
