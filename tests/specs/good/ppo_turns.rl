# PPO on rewards per turn: a multi-turn environment's step rewards (--env with --reward env)
# each land on the last token of the model's turn they answer, and GAE runs over those token
# rewards (verl's compute_gae_advantage_return fed token_level_rewards); whitened as PPO's.
# Without `rewards dense` the same spec sees one reward per episode, their sum, on its last token.
algorithm ppo_turns extends ppo
  "PPO with token-level GAE on per-turn rewards (environment steps, process reward model steps)."
  rewards   dense
