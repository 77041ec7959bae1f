algorithm demo
  'A test spec.'
