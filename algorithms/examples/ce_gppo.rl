# CE-GPPO (Su et al. 2025, "CE-GPPO: Coordinating Entropy via Gradient-Preserving Clipping Policy
# Optimization in Reinforcement Learning", arXiv 2509.20712; code github.com/Kwai-Klear/CE-GPPO,
# loss in github.com/Kwai-Klear/KlearReasoner verl core_algos.py compute_gppo_loss_general_beta).
# A token clipped by PPO keeps its clipped value but not a zero gradient: a negative-advantage token
# below 1 - eps gets beta1 (1 - eps) times the gradient of log pi, a positive one above 1 + eps
# beta2 (1 + eps) times it (rho / sg(rho) is 1 with the gradient of log pi); then verl's dual clip
# (c = 10). beta1 = 0.5, beta2 = 1 and eps 0.2 / 0.2 as the authors' 1.5B run; no overlong
# penalty (disabled there); GRPO advantages, token mean, dynamic sampling, no KL. Plus the run's
# NLL on correct answers (positive_loss_coeff 0.1), as gppo.rl writes it.
algorithm ce_gppo extends dapo
  "PPO clip whose clipped tokens keep a scaled gradient (beta1 below, beta2 above), dual clip."
  define gradient_preserving_clip
    low = 0.2
    high = 0.2
    beta1 = 0.5
    beta2 = 1.0
    c = 10.0
    nll = 0.1
    g = rho / sg(rho)
    l0 = where(A < 0, where(rho < 1 - low, -beta1 * (1 - low) * g * A, -rho * A), where(A > 0, where(rho > 1 + high, -beta2 * (1 + high) * g * A, -rho * A), -rho * A))
    correct = where(reward == 1, 1, 0)
    l = where(A < 0, min(-A * c, l0), l0) + nll * correct * (-logp) * batch_sum(mask) / max(batch_sum(correct * mask), 1)
  end
  shaping       none
  trust_region  none
  objective     gradient_preserving_clip
