# DCPO whole (Yang et al. 2025, "DCPO: Dynamic Clipping Policy Optimization", arXiv 2509.02333;
# code github.com/lime-RL/DCPO @ 2778707, verl/trainer/ppo/core_algos.py get_mean_std and
# compute_dcpo_outcome_advantage): its smooth advantage standardization (SAS) with dcpo.rl's loss
# (the dynamic adaptive clipping, unchanged) and recipe/dcpo/run_dcpo.sh's settings (no filter of
# all-equal groups: `sampling once`; no overlong buffer: `shaping none`).
#
# SAS, per prompt seen for the (n + 1)-th time: the step's group z-score z_new = (r - mean_g) /
# std_g (std_g Bessel's, torch.std; 0 where std_g = 0) and a cumulative one z_all = (r - M) / S
# over every step the prompt was seen in, this one included (0 where S = 0), mixed both ways by
# w = 1 / (n + 1): a1 = w z_all + (1 - w) z_new, a2 = w z_new + (1 - w) z_all, and the one of
# smaller magnitude kept. The authors' recursion keeps M, S per prompt as
#   M' = (n M + mean_g) / (n + 1),
#   S'^2 = (n S^2 + std_g^2 + n / (n + 1) (mean_g - M)^2) / (n + 1),
# which unrolls to: M the mean of the steps' group means, S^2 the mean of the steps' Bessel
# variances plus the population variance of the step means. With G rewards per step that is
# prompt_mean and prompt_var + prompt_step_var / G: the pooled population variance holds the
# steps' population variances ((G - 1) / G of each Bessel one) plus the variance of the means.
# (The authors' trainer keeps that history when reward_model.use_old_mean.enable is set,
# recipe/dcpo/src/dcpo_ray_trainer.py; without it every step reads n = 0 and SAS is GRPO's z.)
algorithm dcpo_sas extends dapo
  "Smooth advantage standardization over the prompt's steps, dynamic adaptive clipping, token mean."
  define smooth_advantage_standardization
    w = 1 / max(prompt_steps, 1)                      # 1 / (n + 1): n the prompt's earlier steps (0: every reward failed)
    sd_new = group_std(r)
    z_new = where(sd_new > 0, (r - group_mean(r)) / sd_new, 0)
    sd_all = sqrt(prompt_var + prompt_step_var / G)
    z_all = where(sd_all > 0, (r - prompt_mean) / sd_all, 0)
    a1 = w * z_all + (1 - w) * z_new
    a2 = w * z_new + (1 - w) * z_all
    A = where(abs(a1) < abs(a2), a1, a2)
  end
  define dynamic_adaptive_clip
    eps_low = 0.16
    eps_high = 0.2
    c = 3.0
    q = exp(old_logp)
    lo = (1 + sqrt(max(1 - 4 * eps_low / q, 0))) / 2
    hi = min((1 + sqrt(1 + 4 * eps_high / q)) / 2, max(c, 10))
    l0 = max(-A * rho, -A * clamp(rho, lo, hi))
    l = where(A < 0, min(-A * c, l0), l0)
  end
  sampling      once
  shaping       none
  baseline      smooth_advantage_standardization
  normalizer    none
  trust_region  none
  objective     dynamic_adaptive_clip
