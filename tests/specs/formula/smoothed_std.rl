# Smoothed advantage standardisation (a sketch written for the per-prompt statistics, not one
# paper's transcription): GRPO divides the group-centred reward by the std of the group's G
# rewards alone, noisy for small G and 0 (then eps-blown) for a group that happens to agree. Here
# the std is that of every reward the prompt earned so far, over every step it was seen in, this
# one included (`prompt_var`: the run keeps it per prompt, saves it in checkpoints, and a resumed
# run reads what the uninterrupted run would). A prompt whose rewards never differed keeps A = 0.
algorithm smoothed_std extends grpo
  "GRPO advantages divided by the running std of the prompt's rewards across steps."
  define running_std
    eps = 1e-6
    A = (r - group_mean(r)) / (sqrt(prompt_var) + eps)
  end
  baseline    running_std
  normalizer  none
