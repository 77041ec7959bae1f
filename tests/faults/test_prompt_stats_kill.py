"""SIGKILL of a run whose spec reads the per-prompt statistics across steps (prompt_var, in
tests/specs/formula/smoothed_std.rl; prompt_steps and prompt_step_var too, in DCPO's
algorithms/examples/dcpo_sas.rl), then `rldsl run --resume`: the statistics come back from the
checkpoint, so the resumed run equals its uninterrupted twin (steps, samples, weights bit for bit),
synchronous and asynchronous (the batches generated ahead were folded in before the save)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rldsl.runtime.config import load_config
from rldsl.runtime.run import loop

from fault_helpers import BASE, assert_same_weights, final_weights, run_args, samples_of, step_numbers, steps_of
from test_kill_resume import KILLED, faulted_then_resumed

ROOT = Path(__file__).resolve().parents[2]
SMOOTHED = str(ROOT / "tests" / "specs" / "formula" / "smoothed_std.rl")
DCPO_SAS = str(ROOT / "algorithms" / "examples" / "dcpo_sas.rl")


def _data(tmp_path: Path) -> tuple[str, ...]:
    """4 training prompts, 2 a step (BASE): each comes back every other step, so a step after the
    resume reads statistics holding rewards of steps before the kill."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(10, 16)))
    return (f"data.path={data}", "data.eval_size=2")


@pytest.mark.parametrize("spec,sets", [(SMOOTHED, ()), (SMOOTHED, ("rollout.max_staleness=1",)), (DCPO_SAS, ())],
                         ids=["sync", "async", "dcpo_sas"])
def test_a_run_reading_prompt_statistics_killed_resumes_exactly(model_dir, tmp_path, spec, sets):
    over = _data(tmp_path) + sets
    run = tmp_path / "run"
    args = run_args(model_dir, run, *over)
    args[1] = spec  # run_args names grpo
    faulted_then_resumed(run, args, [("update@4:kill", KILLED), ("checkpoint@5:kill", KILLED)])
    ref = loop.train(spec, load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'ref'}", *BASE, *over]))
    assert step_numbers(run) == [1, 2, 3, 4, 5, 6]
    assert steps_of(run) == steps_of(ref)
    assert samples_of(run) == samples_of(ref)
    assert_same_weights(final_weights(run), final_weights(ref))
