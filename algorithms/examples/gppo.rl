# GPPO of Klear-Reasoner (Su et al. 2025, "Klear-Reasoner: Advancing Reasoning Capability via
# Gradient-Preserving Clipping Policy Optimization", arXiv 2508.07629; code
# github.com/Kwai-Klear/KlearReasoner, verl core_algos.py compute_gppo_loss): PPO's clip whose
# bounds carry the ratio's gradient -- clamp(rho, (1 - eps_l) rho / sg(rho), (1 + eps_h) rho /
# sg(rho)) has clip's value, and a clipped token keeps (1 - eps_l) or (1 + eps_h) times the
# gradient of log pi instead of none; then verl's dual clip (c = 10). eps 0.2 / 0.28 as the
# authors' math run; GRPO advantages, token mean, no KL, no overlong penalty. Plus the run's
# NLL on correct answers (positive_loss_coeff 0.1): 0.1 x the token mean of -log pi over the
# answers whose reward is the correct score 1 (`reward`, the sequence's reward), written in the
# token mean as each such token's -log pi times N / N_correct.
algorithm gppo extends dapo
  "PPO clip with gradient-carrying bounds (clipped tokens keep a bounded gradient), dual clip."
  define gradient_preserving_bounds
    low = 0.2
    high = 0.28
    c = 10.0
    nll = 0.1
    g = rho / sg(rho)
    l0 = max(-A * rho, -A * clamp(rho, (1 - low) * g, (1 + high) * g))
    correct = where(reward == 1, 1, 0)
    l = where(A < 0, min(-A * c, l0), l0) + nll * correct * (-logp) * batch_sum(mask) / max(batch_sum(correct * mask), 1)
  end
  shaping       none
  trust_region  none
  objective     gradient_preserving_bounds
