algorithm demo
  "A test spec."
  shaping       none, overlong_penalty(max_len=1024, cache=128)
