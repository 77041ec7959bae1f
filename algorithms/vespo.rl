# VESPO ("Variational Sequence-Level Soft Policy Optimization", arXiv 2602.10693): no clip; the
# sequence likelihood ratio w (product of token ratios, log w clamped to [log 1e-8, 20]) sets a
# stop-gradient weight phi(w) = e^lam w^k e^(-lam w) on -A log pi, with k = 2, lam = 3 for
# A >= 0 and k = 3, lam = 2 for A < 0. Token-level loss, no KL. TRL loss_type="vespo".
algorithm vespo extends grpo
  "A Gamma-shaped weight of the sequence ratio on -A log pi, instead of a clip."
  ratio         product(clamp=20.0)
  objective     is_weighted
  trust_region  gamma_weight(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
  kl            none
  aggregation   token_mean
