"""SIGKILL of a run with ``sampling replay`` (no agent: one row per sample), mid-update and in the
middle of writing a checkpoint, then ``rldsl run --resume``: the buffer (its groups, their
recorded logprobs, versions and priorities, the draw's state) comes back from the last whole
checkpoint, so the resumed run equals its uninterrupted twin -- steps, samples and weights --
replay included (issue 61), synchronous and asynchronous."""
from __future__ import annotations

import pytest

from rldsl.runtime.config import load_config
from rldsl.runtime.rollout.replay import FRACTION
from rldsl.runtime.run import loop

from fault_helpers import BASE, assert_same_weights, final_weights, run_args, samples_of, step_numbers, steps_of
from test_kill_resume import KILLED, faulted_then_resumed

SPEC = '''algorithm grpo_replay_kill extends grpo
  sampling  replay(capacity=4, use=mix, mix=0.5, priority="std * sum(abs(adv))", max_age=3)
'''


@pytest.mark.parametrize("sets", [(), ("rollout.max_staleness=1",)], ids=["synchronous", "async"])
def test_a_run_with_replay_killed_resumes_as_its_twin(model_dir, tmp_path, sets):
    spec = tmp_path / "replay.rl"
    spec.write_text(SPEC, encoding="utf-8")
    run = tmp_path / "run"
    args = run_args(model_dir, run, *sets)
    args[1] = str(spec)  # run_args names grpo
    faulted_then_resumed(run, args, [("update@4:kill", KILLED), ("checkpoint@5:kill", KILLED)])
    ref = loop.train(str(spec), load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'ref'}",
                                                   *BASE, *sets]))
    records = steps_of(ref)
    assert any(r[FRACTION] > 0 for r in records[3:]), "the steps after the kills replay groups"
    assert step_numbers(run) == [1, 2, 3, 4, 5, 6]
    assert steps_of(run) == records
    assert samples_of(run) == samples_of(ref)
    assert_same_weights(final_weights(run), final_weights(ref))
