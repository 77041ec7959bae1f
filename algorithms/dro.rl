# DRO (Richemond et al. 2024, "Offline Regularised Reinforcement Learning for LLM Alignment",
# arXiv 2405.19107) as verl's loss_mode=dro writes it: REINFORCE on the group advantages plus a
# quadratic penalty on the log ratio to the old policy, -(A log pi - beta/2 (log rho)^2);
# beta 0.05 as verl's example. verl does not clamp log rho: the clamp here is out of reach
# (80 keeps exp() finite in float32). Token-level loss, no KL to a reference.
algorithm dro extends grpo
  "REINFORCE with a quadratic log-ratio penalty to the old policy instead of a clip."
  ratio         token(clamp=80.0)
  objective     dro(beta=0.05)
  trust_region  none
  kl            none
  aggregation   token_mean
