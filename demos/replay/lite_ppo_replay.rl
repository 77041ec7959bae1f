# Lite PPO with a replay buffer (docs/replay.md): each step's groups whose rewards are all
# equal (no gradient) are replaced by informative groups kept from earlier steps, drawn by
# TRL's priority (|advantage| x std), at most 4 policy versions old.
algorithm lite_ppo_replay extends lite_ppo
  "Lite PPO; each step's zero-variance groups replaced by kept informative groups."
  sampling  replay(capacity=64, priority="std * sum(abs(adv))", max_age=4)
