algorithm demo
  "A formula test."
  define cut
    keep = L <= group_quantile(L, r)
  end
  filter  cut
