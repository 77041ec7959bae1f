# NFT, Negative-aware Fine-Tuning (Chen et al. 2025, "Bridging Supervised Learning and Reinforcement
# Learning in Math Reasoning", arXiv 2505.18116; code github.com/NVlabs/NFT, dp_actor.py
# update_policy (neg_weight >= 0, ratio_type "token") and ray_nft_trainer.py): no advantage in the
# loss. With rewards +-1, c = (r + 1) / 2 (right or not) and the group's success rate
# q = clamp(mean c, 0.02, 0.98), a right answer's token loses -log rho and a wrong one's
# -log((1 - q rho) / (1 - q)) -- the likelihood of the implicit negative policy -- with the argument
# of that log floored at 1 in value only (the authors' clamp_preserve_grad keeps the gradient);
# rho = exp(min(log pi - log pi_old, 10)); every term times 1 - q, summed over tokens and divided by
# 1000. The authors' train_7B.sh: neg_weight 1, clamp_negative 1, normalize 1, no KL, no entropy,
# DAPO's group filter (10 rounds), no overlong penalty.
algorithm nft extends dapo
  "Negative-aware fine-tuning: likelihood on right answers, implicit negative policy on wrong ones."
  define negative_aware
    lr_max = 10.0
    floor = 1.0
    low = 0.02
    high = 0.98
    rho_c = exp(min(logp - old_logp, lr_max))
    c = (reward + 1) / 2
    q = clamp(group_mean(c), low, high)
    proxy = (1 - q * rho_c) / (1 - q)
    l = (-log(proxy + sg(max(proxy, floor) - proxy)) * (1 - c) - log(rho_c) * c) * (1 - q)
  end
  define per_thousand_tokens
    weights = mask
    count = 1000
  end
  shaping       none
  trust_region  none
  objective     negative_aware
  aggregation   per_thousand_tokens
