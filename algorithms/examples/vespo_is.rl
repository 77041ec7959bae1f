# VESPO (arXiv 2602.10693) with the train/inference correction TRL applies to it (loss_type="vespo",
# vllm_importance_sampling_correction, mode token_truncate, cap 3): the engine's importance
# weight min(pi_old / pi_engine, 3) is not multiplied into the loss, as for the other loss
# types, but folded into the sequence ratio inside VESPO's Gamma weight phi:
#   log w_i = clamp(sum_t clamp(log rho_it, -20, 20) + sum_t clamp(log min(pi_old / pi_engine, 3), log 1e-8, 20), log 1e-8, 20)
#   phi_i = exp(lam + k log w_i - lam w_i),  (k, lam) = (2, 3) if A >= 0 else (3, 2)
# on -sg(phi) A log pi, token mean. The formula reads rollout_logp, the engine's logprobs, which
# the trust_region slot receives; a run passes them (rollout.engine=vllm makes them differ).
algorithm vespo_is extends grpo
  "VESPO with TRL's vLLM importance weight folded into the sequence ratio inside phi."
  define vespo_is
    k_pos = 2.0
    lambda_pos = 3.0
    k_neg = 3.0
    lambda_neg = 2.0
    cap = 3.0
    lr = clamp(logp - old_logp, -20, 20)
    log_is = clamp(min(old_logp - rollout_logp, log(cap)), log(0.00000001), 20)
    log_w = clamp(seq_sum(lr) + seq_sum(log_is), log(0.00000001), 20)
    k = where(A >= 0, k_pos, k_neg)
    lam = where(A >= 0, lambda_pos, lambda_neg)
    w = sg(exp(lam + k * log_w - lam * exp(log_w)))
  end
  trust_region  vespo_is
  objective     is_weighted
  kl            none
  aggregation   token_mean
