algorithm demo extends grpo
  "A formula test: the correction slot's rejections also run in estimate(), outside the loss."
  define truncated_is
    cap = 2.0
    w = min(exp(old_logp - rollout_logp), cap)
  end
  correction  truncated_is
