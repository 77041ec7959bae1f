"""A run whose spec reads the per-prompt statistics across steps (tests/specs/formula/smoothed_std.rl;
algorithms/examples/dcpo_sas.rl, which reads the per-step ones too): the state lives on the driver,
is saved in every checkpoint, and a run stopped after a checkpoint and resumed equals its
uninterrupted twin (metrics and weights, bit for bit)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rldsl.runtime.records import checkpoint as ckpt
from rldsl.runtime.records.prompt_stats import PromptStats, prompt_key
from rldsl.runtime.run import loop
from small_run import small_run, steps_of, without_timing

REPO = Path(__file__).resolve().parents[3]
SPECS = {"smoothed_std": str(REPO / "tests" / "specs" / "formula" / "smoothed_std.rl"),
         "dcpo_sas": str(REPO / "algorithms" / "examples" / "dcpo_sas.rl")}


def _cfg(model_dir: Path, out: Path, data: Path) -> object:
    # 4 training prompts, 2 a step: each prompt comes back every other step, so the statistics a
    # step reads after the cut hold rewards of steps before it
    return small_run(model_dir, out, **{"data.path": data, "data.eval_size": 2, "rollout.prompts_per_step": 2,
                                        "rollout.max_new_tokens": 4, "train.steps": 6, "checkpoint.every": 2})


def _params(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(ckpt.latest_checkpoint(run) / "policy" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
def test_a_run_reading_prompt_statistics_resumed_equals_its_uninterrupted_twin(model_dir, tmp_path, name):
    spec = SPECS[name]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(10, 16)))
    full = loop.train(spec, _cfg(model_dir, tmp_path / "full", data))
    cut = loop.train(spec, _cfg(model_dir, tmp_path / "cut", data), stop_after=3)
    assert ckpt.latest_checkpoint(cut).name == "step-3"
    loop.train(spec, resume=cut)
    assert without_timing(steps_of(cut)) == without_timing(steps_of(full))
    a, b = _params(full), _params(cut)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

    # the saved state: 6 steps x 2 prompts x 4 samples folded in, each of the 4 prompts 3 times;
    # its reward sum is every step's (reward_mean x 8 rows)
    saved = ckpt.load_checkpoint(ckpt.latest_checkpoint(full)).extra["prompt_stats"]
    stats = PromptStats()
    stats.load_state_dict(saved)
    assert len(stats) == 4
    count, mean = saved["stats"][:, 0], saved["stats"][:, 1]
    assert count.tolist() == [12.0] * 4
    assert saved["stats"][:, 3].tolist() == [3.0] * 4  # each prompt's groups: one a step it was seen in
    total = sum(r["reward_mean"] * 8 for r in steps_of(full))
    assert float((count * mean).sum()) == pytest.approx(total, abs=1e-9)
    trained = {prompt_key(f"{a}+1=") for a in range(10, 16)}  # the training prompts are among these
    assert set(saved["keys"].tolist()) <= trained
    resumed = ckpt.load_checkpoint(ckpt.latest_checkpoint(cut)).extra["prompt_stats"]
    assert torch.equal(resumed["keys"], saved["keys"]) and torch.equal(resumed["stats"], saved["stats"])
