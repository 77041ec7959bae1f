# Lite PPO with a replay buffer mixed in (docs/replay.md): a quarter of each step's groups
# come from the buffer once it holds them, so the step generates only the rest.
algorithm lite_ppo_replay_mix extends lite_ppo
  "Lite PPO; a quarter of each step's groups replayed from the buffer, the rest generated."
  sampling  replay(capacity=64, priority="std * sum(abs(adv))", use=mix, mix=0.25, max_age=4)
