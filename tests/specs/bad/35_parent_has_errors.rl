algorithm child extends broken_parent
  kl            none
