"""group_by=FIELD in a run: a dataset column reaches each prompt (Example.fields), the rollout
producer turns its values into group_keys (stable across steps), and the keyed ema baseline's
state goes through a checkpoint and continues bit-exact."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import rldsl
from rldsl.runtime.batch import RolloutBatch
from rldsl.runtime.data.datasets import Example, load_examples, render_prompt
from rldsl.runtime.errors import DataError
from rldsl.runtime.records.checkpoint import load_checkpoint, save_checkpoint
from rldsl.runtime.train import inputs as producers
from rldsl.runtime.workers.local_trainers import LocalTrainers

SPEC = 'algorithm roles\n  "per-role ema"\n  baseline ema(decay=0.5, group_by=role)\n  objective reinforce\n'


def _algo() -> rldsl.CompiledAlgorithm:
    return rldsl.compile(rldsl.loads(SPEC, filename="roles.rl"), compile=False)


def test_a_dataset_column_reaches_the_prompt_and_survives_rendering(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "p0", "answer": "1", "role": "solver", "level": 3, "tags": ["x"]},
            {"prompt": "p1", "answer": "2", "role": "critic", "level": 1, "tags": []}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    ex = load_examples(path)
    assert ex[0].fields == (("role", "solver"), ("level", 3))  # plain values only: no list column
    assert render_prompt(ex[1], None, mode="off", system_prompt="S").column("role") == "critic"
    with pytest.raises(DataError, match="no column 'task'.*'role', 'level'"):
        ex[0].column("task")


def _batch(B: int, G: int) -> RolloutBatch:
    return RolloutBatch(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long),
                        torch.zeros(B, 2, dtype=torch.long), torch.ones(B, 2), torch.zeros(B, 2),
                        ["stop"] * B, ["p"] * B, ["c"] * B, G)


def test_the_rollout_producer_keys_rows_by_the_fields_value():
    algo = _algo().algorithm
    assert [p.make for p in producers.rollout_producers(algo)] == [producers.field_keys]
    side = producers.RolloutSide(None, [], 4, print, 1, group_by=algo.group_by)
    prompts = [Example(0, "a", "1", fields=(("role", "solver"),)), Example(1, "b", "2", fields=(("role", "critic"),)),
               Example(2, "c", "3", fields=(("role", "solver"),))]
    batch, _ = producers.field_keys(side, _batch(6, 2), None, prompts)
    k = batch.inputs["group_keys"]
    assert k.dtype == torch.int64 and k.tolist()[0::2] == k.tolist()[1::2]  # repeated over G
    assert k[0] == k[4] != k[2]  # the same role in two prompts: one group
    assert k[0] == producers.field_key("solver")  # a value's key is the same in every step
    assert producers.field_key(1) != producers.field_key("1")
    assert producers.ESTIMATE["group_keys"](None, batch, None) is k
    with pytest.raises(DataError, match="no column 'role'"):
        producers.field_keys(side, _batch(2, 2), None, [Example(0, "a", "1")])


def _trainer(fn: rldsl.CompiledAlgorithm) -> LocalTrainers:
    policy = torch.nn.Linear(2, 1)
    return LocalTrainers(SimpleNamespace(policy=policy, critic=None, critic_optimizer=None, fn=fn, scheduler=None,
                                         optimizer=torch.optim.SGD(policy.parameters(), lr=0.1),
                                         teacher_state=lambda: None,  # no teacher.ema teacher
                                         load_teacher_state=lambda state: None,
                                         loss_scaler=None))  # float32: no loss scale


def _step(fn: rldsl.CompiledAlgorithm, r: list[float], roles: list[str]) -> torch.Tensor:
    keys = torch.tensor([producers.field_key(x) for x in roles])
    return fn.advantages(torch.tensor(r), 2, torch.ones(len(r), 1), group_keys=keys)


def test_the_keyed_ema_resumes_bit_exact_from_a_checkpoint(tmp_path):
    steps = [([0.1, 0.7, 0.3, 0.2], ["solver", "solver", "critic", "critic"]),
             ([0.9, 0.4, 0.6, 0.35], ["solver", "judge", "judge", "solver"]),
             ([0.3, 0.8, 0.15, 0.5], ["critic", "solver", "judge", "critic"])]
    run = _trainer(_algo())
    for r, roles in steps[:2]:
        _step(run.trainer.fn, r, roles)
    st = run.checkpoint_state()
    path = save_checkpoint(tmp_path, 2, policy=st.policy, tokenizer=None, optimizer=st.optimizer,
                           scheduler=None, extra_state={"algorithm": st.algorithm})
    resumed = _trainer(_algo())
    resumed.load_checkpoint(load_checkpoint(path))
    assert torch.equal(_step(resumed.trainer.fn, *steps[2]), _step(run.trainer.fn, *steps[2]))
    a, b = run.trainer.fn.state_dict(), resumed.trainer.fn.state_dict()
    assert list(a) == ["ema_keys", "ema_values"] and len(a["ema_keys"]) == 3
    assert all(torch.equal(a[k], b[k]) for k in a)
