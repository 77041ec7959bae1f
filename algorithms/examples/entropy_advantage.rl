# Entropy-based advantage (Cheng et al. 2025, "Reasoning with Exploration: An Entropy
# Perspective", arXiv 2506.14758): the advantage gains a clipped, gradient-free entropy term,
# A' = A + psi with psi = min(alpha * sg(H), |A| / kappa), which favours high-entropy
# (exploratory) tokens without ever flipping the sign of A (kappa > 1). With the PPO loss
# -A' w, the extra part is -psi w: written here as the entropy slot's term. alpha and kappa
# are example values; tune them for your model.
algorithm entropy_advantage extends grpo
  "GRPO with a clipped, detached entropy term added to the advantage."
  define entropy_shaped_advantage
    alpha = 0.4
    kappa = 2.0
    psi = min(alpha * sg(ent), abs(A) / kappa)
    term = -psi * w
  end
  entropy       entropy_shaped_advantage
  kl            none
