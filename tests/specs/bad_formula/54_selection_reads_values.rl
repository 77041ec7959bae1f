algorithm demo extends grpo
  "A formula test: a selection formula reads the tokens' logprobs and entropy, not rewards."
  define keep_good
    keep = r > 0
  end
  selection  keep_good
