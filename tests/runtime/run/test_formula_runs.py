"""Specs with formulas train through the runtime like any spec: the examples and a spec with
a formula in every loss slot, three steps each on the tiny random model."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

import rldsl
from rldsl.runtime.run import loop
from rldsl.runtime.config import load_config
from rldsl.runtime.records.metrics import read_metrics

REPO = Path(__file__).resolve().parents[3]
SPECS = sorted((REPO / "algorithms" / "examples").glob("*.rl")) + [REPO / "tests" / "specs" / "formula" / "loss_slots.rl"]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.stem)
def test_a_formula_spec_trains(spec: Path, model_dir: Path, tmp_path: Path) -> None:
    sets = [f"model.path={model_dir}", f"out={tmp_path / 'run'}", "rollout.prompts_per_step=4", "rollout.n=4",
            "train.steps=3", "eval.every=0", "eval.samples=2", "data.eval_size=8", "checkpoint.every=0",
            "log.progress=false", "reward.name=reward_helpers:parity", "train.minibatches=2"]
    if "teacher_logp" in spec.read_text():  # a formula reading a teacher: the toy teaches itself
        sets.append(f"teacher.path={model_dir}")
    if "ref_reward" in spec.read_text():  # a formula reading a reference's reward: the toy's own base
        sets.append("reward.reference=policy_base")
    run = loop.train(str(spec), load_config(None, sets))
    recs = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    updated = [r for r in recs if r.get("optimizer_steps", 0) > 0]
    assert updated, f"{spec.stem}: no optimizer step in 3 steps"
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in updated)
    assert (run / "spec.rl").read_text() == rldsl.load(spec).source
