"""``distributed.weight_sync = "collective"`` with the vLLM engine (the CPU build, in .venv-vllm):
trainer rank 0 broadcasts the buckets over the sync's gloo group to a Ray rollout worker, which
hands them to its vLLM engine's in-place reload as they arrive. After every step's sync the
engine's weights, read back through vLLM's kernels, equal the step's checkpoint bit for bit
(float32).

Setup as test_vllm_runs.py (its model and settings); buckets of 0.05 MiB (several per sync).
About two minutes (a vLLM engine starts in the actor): not in the Makefile's VLLM_TESTS; run it
with ``RLDSL_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -m vllm -p no:cacheprovider
tests/runtime/run/test_vllm_collective_sync.py``.
"""
from __future__ import annotations

import pytest

from rldsl.runtime.records.checkpoint import read_weights
from rldsl.runtime.run import loop, schedule

from test_vllm_runs import config, max_difference, steps_of, vllm_model_dir  # noqa: F401 - its fixture

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_collective_sync_to_a_vllm_rollout_worker_leaves_its_engine_equal_to_the_trainer(
        vllm_model_dir, tmp_path, monkeypatch):
    import ray
    real_save = schedule.save
    diffs: list[float] = []

    def checked_save(s, step, producer=None):
        path = real_save(s, step, producer)  # after the step's sync
        assert s.trainers.weights() is s.trainers.sync  # the collective path, not the object store
        engine = ray.get(s.rollouts.actors[0].engine_weights.remote())
        diffs.append(max_difference(engine, read_weights(path / "policy")))
        return path

    monkeypatch.setattr(schedule, "save", checked_save)
    run = loop.train("grpo", config(vllm_model_dir, tmp_path / "run", "distributed.rollout_workers=1",
                                    "distributed.weight_sync=collective", "distributed.sync_bucket_mb=0.05",
                                    "train.steps=2", "checkpoint.every=1", "distributed.sync_timeout=300",
                                    "distributed.collective_timeout=300"))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2]
    assert any(r["optimizer_steps"] > 0 for r in recs)
    assert all(r["time/sync_s"] > 0 and r["sync/bytes"] > 0 for r in recs)
    assert diffs == [0.0, 0.0]
