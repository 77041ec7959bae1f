"""A formula that reads the teacher's logprobs (algorithms/examples/opd_formula.rl) trains: the run
loads the teacher of ``teacher.path`` because the formula reads ``teacher_logp``, its logprobs reach
the loss, and without ``teacher.path`` the run is refused before any model loads, naming the slot."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from rldsl.runtime.errors import ConfigError
from rldsl.runtime.run import loop
from rldsl.runtime.toy import warm_start
from rldsl.runtime.train.trainer import Trainer
from small_run import small_run, steps_of

SPEC = str(Path(__file__).resolve().parents[3] / "algorithms" / "examples" / "opd_formula.rl")


@pytest.mark.slow
def test_a_teacher_formula_trains_three_steps(model_dir, tmp_path, monkeypatch):
    seen = []
    est = Trainer.estimate

    def estimate(self, rollout, rewards):
        out = est(self, rollout, rewards)
        seen.append(out.teacher)
        return out

    monkeypatch.setattr(Trainer, "estimate", estimate)
    run = loop.train(SPEC, small_run(model_dir, tmp_path / "run", **{"teacher.path": warm_start()}))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in recs)
    assert len(seen) == 3 and all(t is not None and bool((t.logprobs <= 0).all()) for t in seen)
    with pytest.raises(ConfigError, match="objective opd_pg learns from a teacher, and teacher.path is not set"):
        loop.train(SPEC, small_run(model_dir, tmp_path / "run2"))
