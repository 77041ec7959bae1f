"""``model.dtype=float16`` on two FSDP2 trainer ranks (gloo, Ray): the ranks compute in float16
(MixedPrecisionPolicy of model.dtype) with float32 master weights, the dynamic loss scaler
unscales the sharded gradients and every rank takes the same decision (the all-reduced norm);
the checkpoint keeps the scale.
Setup as test_ray.py (its cluster, config and reward)."""
from __future__ import annotations

import math

import pytest
import torch

from rldsl.runtime.run import loop

from test_ray import config, params, ray_cluster, steps_of  # noqa: F401 - the module's fixtures

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_float16_trains_on_two_ranks_with_loss_scaling(ray_cluster, model_dir, tmp_path):
    run = loop.train("grpo", config(model_dir, tmp_path / "run", trainers=2, workers=1,
                                    **{"train.steps": 1, "model.dtype": "float16",
                                       "checkpoint.every": 1}))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1]
    assert sum(r["optimizer_steps"] for r in recs) > 0
    for r in recs:
        assert r["train/loss_scale"] in (2.0 ** 16, 2.0 ** 15, 2.0 ** 14)  # starts at 2^16, halves on overflow
        assert r["train/skipped_steps"] <= r["skipped_nonfinite"]
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
    from rldsl.runtime.records.checkpoint import load_checkpoint
    saved = load_checkpoint(run / "checkpoints" / "step-1").extra["loss_scale"]  # rank 0's, gathered
    assert saved["scale"] == recs[0]["train/loss_scale"]
    weights = params(run, 1)
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in weights.values())  # master weights
