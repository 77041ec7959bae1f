algorithm demo
  "A formula test."
  define gate
    keep = L
  end
  filter  gate
