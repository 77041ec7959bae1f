# leading comment

# another, after a blank line
algorithm comments_everywhere extends grpo # after the header
  # before the description
  "Comments may stand anywhere # but a '#' in the description is text." # after it
  # between slots
  trust_region  clip(low=0.2, high=0.28)  # clip-higher
      # indented more than the slots
  filter        zero_variance, overlong # two filters
# at column 1 between slots
  kl            none#no space before the comment
#
# the end
