"""An agent's run with ``sampling replay`` (tests/runtime/agent_helpers.py ``odd_answers_break``:
one row per episode or two, so batches of K = 1 and K = 2 and replayed groups padded to the
batch's K), synchronous and asynchronous, SIGKILLed mid-update and resumed from its last
checkpoint: its steps, samples and weights are the uninterrupted run's -- the buffer's groups of
episodes (their rows, per-token masks, logprobs and versions) restored from the checkpoint, the
same groups drawn and trained."""
from __future__ import annotations

import pytest

from rldsl.runtime.config import load_config
from rldsl.runtime.records.metrics import AGENT_ROWS_PER_EPISODE
from rldsl.runtime.rollout.replay import FRACTION
from rldsl.runtime.run import loop

from fault_helpers import assert_same_weights, final_weights, rldsl, samples_of, step_numbers, steps_of

KILLED = -9
SPEC = '''algorithm grpo_replay extends grpo
  sampling  replay(capacity=4, priority="std * sum(abs(adv))", max_age=3)
'''
SETS = ["rollout.agent=agent_helpers:odd_answers_break", "rollout.agent_concurrency=1",
        "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=3", "train.steps=6",
        "eval.every=0", "data.eval_size=2", "eval.samples=0", "checkpoint.every=2", "log.progress=false",
        "log.samples_per_step=8", "train.lr=0.01", "train.minibatches=2"]


MIX = SPEC.replace("max_age=3", "max_age=3, use=mix, mix=0.5")  # 1 of each step's 2 groups from the buffer


# (the asynchronous mix with seed 4: the default seed's steps never mix groups of different K in)
@pytest.mark.parametrize("text, sets", [(SPEC, ()), (SPEC, ("rollout.max_staleness=1",)), (MIX, ()),
                                        (MIX, ("rollout.max_staleness=1", "seed=4"))],
                         ids=["synchronous", "async K=1", "mix synchronous", "mix async K=1"])
def test_an_agents_run_with_replay_killed_mid_update_resumes_as_its_twin(model_dir, tmp_path, text, sets):
    """Synchronous, and asynchronous (the producer's agent batches ahead, saved with the
    checkpoint; the buffer stepped by the trainer); substituting, and mixing in (a synchronous
    step generates as many groups as the restored buffer leaves to make)."""
    spec = tmp_path / "replay.rl"
    spec.write_text(text, encoding="utf-8")
    run = tmp_path / "run"
    args = ["run", str(spec), "--model", str(model_dir), "--out", str(run)]
    for s in (*SETS, *sets):
        args += ["--set", s]
    res = rldsl(args, fault="update@5:kill")  # after checkpoint step-4, mid-update of step 5
    assert res.returncode == KILLED, res.stderr[-3000:]
    res = rldsl(["run", "--resume", str(run)])
    assert res.returncode == 0, res.stderr[-3000:]
    ref = loop.train(str(spec), load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'ref'}", *SETS,
                                                   *sets]))
    records = steps_of(ref)
    assert step_numbers(run) == [1, 2, 3, 4, 5, 6]
    assert any(r[FRACTION] > 0 for r in records[4:]), "the steps after the cut replay groups"
    assert max(r[AGENT_ROWS_PER_EPISODE] for r in records) > 1.0, "episodes of two rows"
    # a step whose fresh episodes made one row each, trained on a batch of two rows per episode: a
    # kept group of K = 2 replayed in it, the fresh groups padded to K = 2
    one_row = {r["step"] for r in records if r[AGENT_ROWS_PER_EPISODE] == 1.0}
    assert any(x["step"] in one_row and x["agent"]["row"] == 1 for x in samples_of(ref))
    assert steps_of(run) == records and samples_of(run) == samples_of(ref)
    assert_same_weights(final_weights(run), final_weights(ref))
