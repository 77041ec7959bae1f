"""A run of multi-turn episodes with a tool (the calculator task: tool calls in processes of their
own) SIGKILLed as a whole process group while held mid-update, and again while its episodes run
(generation: the tool processes at work) and mid-checkpoint, resumed each time: the episodes'
steps and samples are those of the uninterrupted run. The tool model: tests/conftest.py
``tool_model``."""
from __future__ import annotations

from rldsl.runtime.config import load_config
from rldsl.runtime.records.metrics import TOOL_CALLS_PER_EPISODE
from rldsl.runtime.run import loop

from fault_helpers import (assert_same_weights, final_weights, kill_group, rldsl, samples_of, start, step_numbers,
                           steps_of, wait_held)

SETS = ["data.task=calculator", "rollout.prompts_per_step=2", "rollout.n=2", "train.steps=4", "eval.every=0",
        "data.eval_size=2", "eval.samples=0", "checkpoint.every=2", "log.progress=false", "log.samples_per_step=2"]


def test_an_episode_run_killed_with_its_tool_processes_resumes_exactly(tool_model, tmp_path):
    run = tmp_path / "run"
    args = ["run", "lite_ppo", "--model", str(tool_model), "--out", str(run)]
    for s in SETS:
        args += ["--set", s]
    # step 3 mid-update (after checkpoint step-2, tools have run), then step 3 again while its
    # episodes run, then mid-write of checkpoint step-4
    for i, point in enumerate(["update@3:hold", "generate@3:hold", "checkpoint@4:hold"]):
        held = tmp_path / f"held-{i}"
        proc = start(args, held, point)
        wait_held(proc, held)
        kill_group(proc)  # the driver and its tool processes
        logged = step_numbers(run)  # what the killed process had logged: steps 1 to n, once each
        assert logged == list(range(1, len(logged) + 1)) and logged[:2] == [1, 2]
        args = ["run", "--resume", str(run)]
    res = rldsl(["run", "--resume", str(run)])
    assert res.returncode == 0, res.stderr[-3000:]
    ref = loop.train("lite_ppo", load_config(None, [f"model.path={tool_model}", f"out={tmp_path / 'ref'}", *SETS]))
    assert step_numbers(run) == [1, 2, 3, 4]
    assert steps_of(run) == steps_of(ref) and samples_of(run) == samples_of(ref)
    assert all(r[TOOL_CALLS_PER_EPISODE] > 0 for r in steps_of(run))
    assert_same_weights(final_weights(run), final_weights(ref))
