algorithm demo
  "A test spec."
  shaping       overlong_penalty(max_len=4096)
