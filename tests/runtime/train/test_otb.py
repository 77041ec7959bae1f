"""The optimal token baseline in the runtime: the old-policy forward also returns sum_v pi_v^2,
which reaches estimate(); specs that do not need it never compute it."""
from __future__ import annotations

import pytest
import torch

from rldsl.compiled import CompiledAlgorithm
from rldsl.runtime.run import loop
from rldsl.runtime.train import trainer as tr
from small_run import small_run, steps_of

SPEC = """algorithm otb extends grpo
  "verl adv_estimator=optimal_token_baseline"
  baseline      optimal_token
  normalizer    none
"""


def _spy(monkeypatch):
    """Record the sum_pi_squared option of every logprob forward and every sum_pi_squared estimated."""
    flags: list[bool] = []
    seen: list[torch.Tensor | None] = []
    real = tr.Trainer._token_logprobs

    def token_logprobs(model, fwd, options):
        flags.append(options.sum_pi_squared)
        return real(model, fwd, options)

    est = CompiledAlgorithm.estimate

    def estimate(self, *args, **kwargs):
        seen.append(kwargs.get("sum_pi_squared"))
        return est(self, *args, **kwargs)

    monkeypatch.setattr(tr.Trainer, "_token_logprobs", staticmethod(token_logprobs))
    monkeypatch.setattr(CompiledAlgorithm, "estimate", estimate)
    return flags, seen


@pytest.mark.slow
def test_otb_trains_three_steps_with_sum_pi_squared(model_dir, tmp_path, monkeypatch):
    flags, seen = _spy(monkeypatch)
    spec = tmp_path / "otb.rl"
    spec.write_text(SPEC, encoding="utf-8")
    run = loop.train(str(spec), small_run(model_dir, tmp_path / "run"))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
    assert flags.count(True) == 3  # one old-policy forward per step returns it
    got = [s for s in seen if s is not None]
    assert len(got) == 3
    for s in got:  # [B, Tr] with B = 4 prompts x 4 samples; a probability mass: (0, 1]
        assert s.shape[0] == 16 and bool(((s >= 0) & (s <= 1 + 1e-6)).all())


@pytest.mark.slow
def test_specs_without_it_never_compute_sum_pi_squared(model_dir, tmp_path, monkeypatch):
    flags, seen = _spy(monkeypatch)
    loop.train("grpo", small_run(model_dir, tmp_path / "run"))
    assert flags and not any(flags)
    assert seen and all(s is None for s in seen)
