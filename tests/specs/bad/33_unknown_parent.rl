algorithm my_dapo extends dapoo
  kl            none
