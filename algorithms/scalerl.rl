# ScaleRL (Khatri et al. 2025, arXiv 2510.13786): the recipe that scaled -- CISPO-style
# truncated IS loss (eps_max 5.0, i.e. cap 1+4), batch-level advantage normalisation,
# prompt-level loss averaging, zero-variance filtering and no-positive-resampling (prompts
# with pass rate >= 0.9 retired), no KL.
algorithm scalerl extends cispo
  "CISPO loss, batch-std advantages, prompt-level averaging, zero-variance filtering."
  normalizer    batch_std(eps=1e-6)
  trust_region  truncate(high=4.0)
  aggregation   prompt_mean
  filter        zero_variance, pass_rate_cap(max=0.9)
