# QAE (Wu, Huang, Wu, Zhang, Wang, He 2025, "Quantile Advantage Estimation for Entropy-Safe
# Reasoning", arXiv 2509.22611; code github.com/junkangwu/QAE, verl core_algos.py
# compute_grpo_outcome_advantage: id2mean[idx] = torch.quantile(scores, quantile_k)): DAPO whose
# group baseline is the K-quantile of the group's rewards (linear interpolation, torch.quantile)
# instead of their mean, K = 0.4 (the authors' default); the std normalization stays. On binary
# rewards a hard prompt reinforces its rare successes only and an easy one penalizes its residual
# failures only. The loss is the DAPO recipe's (clip 0.2 / 0.28, dual clip c = 10, token mean).
algorithm qae extends dapo
  "DAPO with a K-quantile group baseline instead of the group mean (K = 0.4)."
  define quantile_baseline
    k = 0.4
    b = group_quantile(r, k)
  end
  baseline      quantile_baseline
  trust_region  dual_clip(low=0.2, high=0.28, c=10.0)
