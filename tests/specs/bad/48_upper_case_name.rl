algorithm GRPO_v2 extends grpo
  kl            none
