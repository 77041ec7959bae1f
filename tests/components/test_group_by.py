"""group_by=FIELD: baselines and normalizers over the rows that share a data field's value
(the group_keys input), across prompts and of any size, and the ema baseline keyed by it
(hand-computed numbers through the generated code; the state through state_dict)."""
from __future__ import annotations

import math

import pytest
import torch

import rldsl
from component_refs import lists, spec_fn
from rldsl import SpecError, SpecErrors

# 3 prompts x G=2; roles a a | b b | a c (keys 1, 2, 3): group a spans prompts 0 and 2, c is alone
R = [1.0, 3.0, 0.0, 2.0, 5.0, 4.0]
KEYS = torch.tensor([1, 1, 2, 2, 1, 3])
M = torch.ones(6, 2)


def adv(slots: str, rewards=R, keys=KEYS) -> list[float]:
    fn = spec_fn(slots + "\nobjective reinforce")
    return lists(fn.advantages(torch.tensor(rewards), 2, M, group_keys=keys)[:, 0])


def test_group_mean_by_field_across_prompts_and_a_group_of_one():
    # a: rows 0, 1, 4 (1, 3, 5: mean 3); b: rows 2, 3 (0, 2: mean 1); c: row 5 alone
    assert adv("baseline group_mean(group_by=role)") == [-2.0, 0.0, -1.0, 1.0, 2.0, 0.0]
    assert adv("baseline group_mean(group_by=role, singleton=reward)") == [-2.0, 0.0, -1.0, 1.0, 2.0, 4.0]
    # without group_by the prompt's pair is the group (the key is not read)
    assert adv("baseline group_mean") == [-1.0, 1.0, -1.0, 1.0, 0.5, -0.5]


def test_leave_one_out_by_field():
    # a: 1 - (3+5)/2, 3 - (1+5)/2, 5 - (1+3)/2; b: 0 - 2, 2 - 0; c alone: 0 (or r with singleton=reward)
    assert adv("baseline leave_one_out(group_by=role)") == [-3.0, 0.0, -2.0, 2.0, 3.0, 0.0]
    assert adv("baseline leave_one_out(group_by=role, singleton=reward)")[5] == 4.0


def test_group_std_by_field():
    # Bessel std: a (1, 3, 5) = 2, b (0, 2) = sqrt 2, c alone = 1
    got = adv("baseline group_mean(group_by=role)\nnormalizer group_std(eps=0, group_by=role)")
    assert got == pytest.approx([-1.0, 0.0, -1 / math.sqrt(2), 1 / math.sqrt(2), 1.0, 0.0], abs=1e-7)


def test_success_rate_by_field():
    # roles a a b b a b over binary rewards: a (1, 0, 0) p = 1/3, b (1, 1, 0) p = 2/3
    got = adv("rewards binary\nbaseline group_mean(group_by=role)\nnormalizer success_rate(eps=1e-9, group_by=role)",
              rewards=[1.0, 0.0, 1.0, 1.0, 0.0, 0.0], keys=torch.tensor([1, 1, 2, 2, 1, 2]))
    assert got == pytest.approx([2.0, -1.0, 0.5, 0.5, -1.0, -1.0], abs=1e-6)


def test_a_failed_reward_leaves_its_field_group():
    # row 4 (role a) failed: a's mean is that of rows 0 and 1 (2), the failed row has no tokens
    got = adv("baseline group_mean(group_by=role)", rewards=[1.0, 3.0, 0.0, 2.0, float("nan"), 4.0])
    assert got == [-1.0, 1.0, -1.0, 1.0, 0.0, 0.0]


def test_group_by_without_the_keys_is_refused_by_name():
    fn = spec_fn("baseline group_mean(group_by=role)\nobjective reinforce")
    with pytest.raises(ValueError, match="group_keys= for baseline group_mean"):
        fn.advantages(torch.tensor(R), 2, M)
    assert "group_keys" in fn.algorithm.needs() and fn.algorithm.group_by == "role"
    plain = spec_fn("baseline group_mean\nobjective reinforce")
    assert "group_keys" not in plain.algorithm.needs() and plain.algorithm.group_by is None


EMA = "baseline ema(decay=0.5, group_by=role)\nobjective reinforce"
STEPS = [([1.0, 3.0, 0.0, 2.0], [1, 1, 2, 2]),   # a: 1, 3; b: 0, 2
         ([4.0, 6.0, 5.0, 0.0], [1, 1, 3, 3]),   # a again, c new, b absent
         ([0.0, 1.0, 3.0, 3.0], [2, 1, 3, 2])]   # every role, mixed across prompts


def ema_step(fn, k: int) -> list[float]:
    r, keys = STEPS[k]
    return lists(fn.advantages(torch.tensor(r), 2, torch.ones(4, 1), group_keys=torch.tensor(keys))[:, 0])


def test_ema_keyed_by_field_over_three_steps():
    fn = spec_fn(EMA)
    # step 1: a and b first seen: b_0 = their batch means (2, 1); b_1(a) = 2, b_1(b) = 1
    assert ema_step(fn, 0) == [-1.0, 1.0, -1.0, 1.0]
    assert lists(fn.state_dict()["ema_values"]) == [2.0, 1.0]
    # step 2: a against 2; c first seen (mean 2.5); b_2(a) = .5*2 + .5*5 = 3.5, b kept at 1
    assert ema_step(fn, 1) == [2.0, 4.0, 2.5, -2.5]
    # step 3: b against 1, a against 3.5, c against 2.5
    assert ema_step(fn, 2) == [-1.0, -2.5, 0.5, 2.0]
    state = fn.state_dict()
    assert state["ema_keys"].tolist() == [1, 2, 3] and state["ema_keys"].dtype == torch.int64
    assert lists(state["ema_values"]) == [2.25, 1.25, 2.75]  # .5*3.5+.5*1, .5*1+.5*1.5, .5*2.5+.5*3


def test_ema_keyed_state_dict_round_trip_is_bit_exact():
    fn = spec_fn(EMA)
    for k in range(2):
        ema_step(fn, k)
    fresh = spec_fn(EMA)
    fresh.load_state_dict(fn.state_dict())
    assert ema_step(fresh, 2) == ema_step(fn, 2)
    for name, t in fn.state_dict().items():
        assert torch.equal(t, fresh.state_dict()[name]), name


def test_explain_says_what_the_groups_are():
    from rldsl import explain
    algo = spec_fn("baseline group_mean(group_by=role)\nnormalizer group_std\nobjective reinforce").algorithm
    notes = {v.slot: explain.fact_notes(v.spec, v.params) for v in algo.active()}
    assert "groups: the rows with the same role (across prompts)" in notes["baseline"]
    assert "needs group_keys=" in notes["baseline"]
    assert not any(n.startswith("groups") for n in notes["normalizer"])  # a prompt's group: no note
    assert str(algo["baseline"]) == "group_mean(singleton=zero, group_by=role)"


def _load_error(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        rldsl.loads(text, filename="g.rl")
    e = info.value
    return e.errors[0] if isinstance(e, SpecErrors) else e


def test_check_refuses_group_by_where_it_is_not_taken():
    e = _load_error('algorithm g\n  "t"\n  baseline batch_mean(group_by=role)\n')
    assert (e.line, e.column) == (3, 23)
    assert "unknown argument 'group_by' for baseline batch_mean" in e.render()
    assert e.render().startswith("g.rl:3:23: error:")


def test_check_refuses_a_group_by_that_is_not_a_field_name():
    e = _load_error('algorithm g\n  "t"\n  baseline group_mean(group_by=3)\n')
    assert (e.line, e.column) == (3, 32) and "takes the name of a data field" in e.message


def test_check_refuses_two_group_fields():
    e = _load_error('algorithm g\n  "t"\n  baseline group_mean(group_by=role)\n'
                    '  normalizer group_std(group_by=task)\n')
    assert (e.line, e.column) == (4, 14)
    assert "groups by 'task' but baseline 'group_mean' by 'role'" in e.message
