# The DAPO loss as TRL's GRPOTrainer computes it with loss_type="dapo" (bench/vs_trl.py):
# group-mean baseline, group std with TRL's eps 1e-4 (scale_rewards="group"), PPO clip
# 0.2 / 0.28, global token-mean, no KL -- and none of DAPO's data-level tricks, which
# GRPOTrainer does not have: every group drawn once, no overlong shaping.
algorithm dapo_like extends dapo
  "DAPO loss (clip-higher, token-mean) with TRL's std eps; sampling once, no shaping."
  normalizer    group_std(eps=1e-4)
  sampling      once
  shaping       none
