"""`entropy adaptive` in the runtime: the coefficient moves once per optimizer step from the
step's measured entropy (TRL's rule), is logged as `entropy_coef`, and a run cut and resumed
from its checkpoint gives the same coefficient sequence (it is saved with the algorithm state)."""
from __future__ import annotations

import pytest

from rldsl.runtime.run import loop
from small_run import small_run, steps_of, without_timing

SPEC = """algorithm adaptive_test
  "GRPO with TRL's adaptive entropy coefficient."
  baseline      group_mean
  normalizer    group_std(eps=1e-4)
  entropy       adaptive(init=0.01, min=0.0, max=0.035, delta=0.01, target={target})
  aggregation   token_mean
"""


def _trl(records, init, lo, hi, delta, target):
    """TRL's controller fed with the logged per-step entropies (one optimizer step per step)."""
    coef, out = init, []
    for r in records:
        coef = min(coef + delta, hi) if r["entropy"] <= target else max(coef - delta, lo)
        out.append(coef)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("target", [100.0, 0.0])
def test_coefficient_follows_trl_and_survives_a_resume(model_dir, tmp_path, target):
    spec = tmp_path / "adaptive_test.rl"
    spec.write_text(SPEC.format(target=target))
    over = {"train.steps": 5, "checkpoint.every": 2}
    full = loop.train(str(spec), small_run(model_dir, tmp_path / "full", **over))
    recs = steps_of(full)
    coefs = [r["entropy_coef"] for r in recs]
    assert coefs == pytest.approx(_trl(recs, 0.01, 0.0, 0.035, 0.01, target), abs=1e-12)
    assert coefs == pytest.approx([0.02, 0.03, 0.035, 0.035, 0.035] if target else [0.0] * 5, abs=1e-12)
    cut = loop.train(str(spec), small_run(model_dir, tmp_path / "cut", **over), stop_after=3)
    loop.train(str(spec), resume=cut)
    assert without_timing(steps_of(cut)) == without_timing(recs)
