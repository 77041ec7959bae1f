# Archer (Wang et al. 2025, "Stabilizing Knowledge, Promoting Reasoning: Dual-Token Constraints for
# RLVR", arXiv 2507.15778; code github.com/wizard-III/ArcherCodeR, verl core_algos.py
# compute_policy_loss(use_token_entropy_separate=True) and dp_actor.py's entropy mask and KL).
# Tokens are split by entropy within their own response: a token at most the sequence's
# 0.8-quantile of entropy (linear interpolation over the sequence's tokens, torch.nanquantile) is a
# "knowledge" token: tight clip 0.2 and the k3 KL (low_var_kl, beta 0.001) averaged over those
# tokens only; a higher-entropy "reasoning" token gets clip 0.5 and no KL. verl's dual clip c = 10,
# GRPO advantages, token mean: the authors' run_archer_qwen2.5_1.5b_code.sh.
algorithm archer extends grpo
  "Entropy-split tokens: tight clip + KL on low-entropy ones, loose clip and no KL on the others."
  define dual_token_clip
    calm_eps = 0.2
    hot_eps = 0.5
    c = 10.0
    q = 0.8
    calm = sg(ent) <= seq_quantile(sg(ent), q)
    clipped = where(calm, clamp(rho, 1 - calm_eps, 1 + calm_eps), clamp(rho, 1 - hot_eps, 1 + hot_eps))
    l0 = max(-A * rho, -A * clipped)
    l = where(A < 0, min(-A * c, l0), l0)
  end
  define calm_token_kl
    beta = 0.001
    q = 0.8
    calm = sg(ent) <= seq_quantile(sg(ent), q)
    x = clamp(ref_logp - logp, -20, 20)
    k3 = clamp(exp(x) - x - 1, -10, 10)
    kl = where(calm, k3, 0) * batch_sum(mask) / max(batch_sum(where(calm, 1, 0)), 1)
  end
  trust_region  none
  objective     dual_token_clip
  kl            calm_token_kl
  aggregation   token_mean
