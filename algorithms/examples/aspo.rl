# ASPO (Wang, Liu, Lin, Hu, Li, Zhang, Zhou, Gai 2025, "ASPO: Asymmetric Importance Sampling Policy
# Optimization", arXiv 2510.06062; code github.com/wizard-III/Archer2.0, verl core_algos.py
# compute_policy_loss_archer with dp_actor.py's entropy mask). Positive-advantage tokens get the
# flipped importance weight: their loss -A (w / sg(w)) / sg(w) has value -A / w and gradient
# -A grad(w) / w^2 (w the clipped ratio), so a token the policy already favours is pushed less;
# negative ones keep PPO's lower clip. Clip ranges follow Archer's dual-token constraint: a token
# whose entropy is at most its sequence's 0.8-quantile (linear interpolation over the sequence's
# tokens, torch.nanquantile) gets 0.2, a higher-entropy one 0.4. Soft dual clip: where the weight
# (negatives) or its inverse (positives) exceeds c = 3 the loss is -A c log pi (REINFORCE with
# weight c). GRPO advantages, k3 KL (low_var_kl, beta 0.001) on every token, token mean -- the
# authors' Qwen2.5-1.5B math script.
algorithm aspo extends grpo
  "Flipped importance weight for positive tokens, entropy-dependent clip ranges, soft dual clip."
  define asymmetric_is
    calm_eps = 0.2
    hot_eps = 0.4
    c = 3.0
    q = 0.8
    calm = sg(ent) <= seq_quantile(sg(ent), q)
    neg = where(calm, max(rho, 1 - calm_eps), max(rho, 1 - hot_eps))
    pos = where(calm, min(rho, 1 + calm_eps), min(rho, 1 + hot_eps))
    l_neg = where(neg > c, -A * c * logp, -A * neg)
    l_pos = where(1 / pos > c, -A * c * logp, -A * (pos / sg(pos)) / sg(pos))
    l = where(A < 0, l_neg, l_pos)
  end
  trust_region  none
  objective     asymmetric_is
  kl            k3(beta=0.001, where=loss, clamp=true)
  aggregation   token_mean
