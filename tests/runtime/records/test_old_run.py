"""A run folder written before issue 58's seams (the token row, the forward record, the weight-sync
interface, the source bound once) still reads back and resumes: tests/fixtures/old_run is a
2-step run of the tiny model (tests/conftest.py ``model_dir``) made by commit 4890959's code
(tests/fixtures/README.md says how). Its samples.jsonl, metrics.jsonl and checkpoint are read
by today's readers, and ``rldsl run --resume`` continues it for one more step."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rldsl.runtime.config import load_config
from rldsl.runtime.records.checkpoint import latest_checkpoint, load_checkpoint
from rldsl.runtime.records.metrics import read_metrics
from rldsl.runtime.records.run_dir import load_run_config
from rldsl.runtime.records.samples import read_samples
from rldsl.runtime.run import loop

OLD_RUN = Path(__file__).resolve().parents[2] / "fixtures" / "old_run"


@pytest.fixture
def old_run(tmp_path) -> Path:
    """A copy of the old run folder (a resume writes into it)."""
    run = tmp_path / "old_run"
    shutil.copytree(OLD_RUN, run)
    return run


def test_an_old_runs_records_and_checkpoint_read_back(old_run):
    step, rows = read_samples(old_run)
    assert step == 2 and len(rows) == 8  # log.samples_per_step=2 groups of rollout.n=4 rows
    assert {"prompt", "completion", "reward", "advantage", "finish_reason", "rewards"} <= rows[0].keys()
    assert [r["step"] for r in read_metrics(old_run / "metrics.jsonl") if "reward_mean" in r] == [1, 2]
    ckpt = load_checkpoint(latest_checkpoint(old_run))
    assert ckpt.step == 2
    assert load_run_config(old_run).rollout.max_new_tokens == 4  # the addition task's, resolved then


@pytest.mark.slow
def test_an_old_run_resumes(old_run, model_dir):
    """Today's code continues the old run from its step-2 checkpoint: step 3 is trained and recorded
    beside the old steps (the run's reward, tests/runtime/reward_helpers.py ``parity``, gives a random
    model both rewards: the updates move the weights)."""
    from safetensors.torch import load_file

    init = load_file(str(model_dir / "model.safetensors"))
    before = load_file(str(old_run / "checkpoints" / "step-2" / "policy" / "model.safetensors"))
    cfg = load_config(None, [f"model.path={model_dir}", f"out={old_run}", "train.steps=3"],
                      base=load_run_config(old_run))
    loop.train("grpo", cfg, resume=old_run)
    assert [r["step"] for r in read_metrics(old_run / "metrics.jsonl") if "reward_mean" in r] == [1, 2, 3]
    assert read_samples(old_run)[0] == 3 and read_samples(old_run, 2)[1][0]["step"] == 2
    after = load_file(str(latest_checkpoint(old_run) / "policy" / "model.safetensors"))
    assert latest_checkpoint(old_run).name == "step-3" and after.keys() == before.keys()
    assert any(not torch.equal(before[k], init[k]) for k in before)  # the old run trained
    assert any(not torch.equal(after[k], before[k]) for k in after)  # and today's trains on
