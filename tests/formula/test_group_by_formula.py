"""group_by=FIELD on a formula (docs/formulas.md, "Groups by a data field"): its group_* reductions
and order operations compare the rows with equal group_keys, across prompts and of any size, as
the registry's group_by components do (hand-computed numbers through the generated code)."""
from __future__ import annotations

import pytest
import torch

import rldsl
from rldsl import SpecError, SpecErrors

# 3 prompts x G=2; roles a a | b b | a c (keys 1, 2, 3): group a spans prompts 0 and 2, c is alone
R = torch.tensor([1.0, 3.0, 0.0, 2.0, 5.0, 4.0])
KEYS = torch.tensor([1, 1, 2, 2, 1, 3])
M = torch.ones(6, 2)


def _fn(define: str, use: str) -> rldsl.CompiledAlgorithm:
    text = f'algorithm keyed\n  "a formula grouped by role"\n{define}\n  {use}\n  objective reinforce\n'
    return rldsl.compile(rldsl.loads(text, filename="keyed.rl"), compile=False)


CENTERED = "  define centered\n    b = group_mean(r)\n  end"
RANKED = "  define ranked\n    A = group_rank(r) / max(group_sum(1) - 1, 1)\n  end"


def _adv(fn: rldsl.CompiledAlgorithm, rewards: torch.Tensor = R) -> list[float]:
    return [round(float(x), 6) for x in fn.advantages(rewards, 2, M, group_keys=KEYS)[:, 0]]


def test_a_formula_baseline_grouped_by_a_field_equals_the_registry_component():
    fn = _fn(CENTERED, "baseline centered(group_by=role)")
    assert fn.algorithm.group_by == "role" and "group_keys" in fn.algorithm.needs("advantage")
    # a: rows 0, 1, 4 (1, 3, 5: mean 3); b: rows 2, 3 (mean 1); c: row 5 alone (its own mean)
    assert _adv(fn) == [-2.0, 0.0, -1.0, 1.0, 2.0, 0.0]
    registry = rldsl.compile(rldsl.loads('algorithm reg\n  "r"\n  baseline group_mean(group_by=role)\n'
                                         '  objective reinforce\n', filename="reg.rl"), compile=False)
    assert _adv(fn) == [round(float(x), 6) for x in registry.advantages(R, 2, M, group_keys=KEYS)[:, 0]]
    # without group_by the same define compares each prompt's pair, and reads no key
    plain = _fn(CENTERED, "baseline centered")
    assert plain.algorithm.group_by is None and "group_keys" not in plain.algorithm.needs()
    assert _adv(plain) == [-1.0, 1.0, -1.0, 1.0, 0.5, -0.5]
    assert "batch.group_keys" in fn.source and "batch.group_keys" not in plain.source


def test_order_operations_grouped_by_a_field_rank_within_the_key_stably():
    fn = _fn(RANKED, "baseline ranked(group_by=role)")
    # a: r = 1, 3, 5 at rows 0, 1, 4 -> ranks 0, 1, 2 over 2; b: 0, 2 -> 0, 1 over 1; c alone: 0
    assert _adv(fn) == [0.0, 0.5, 0.0, 1.0, 1.0, 0.0]
    ties = torch.tensor([2.0, 2.0, 0.0, 0.0, 2.0, 4.0])  # a: three ties -> ranks 0, 1, 2 by row
    assert _adv(fn, ties) == [0.0, 0.5, 0.0, 1.0, 1.0, 0.0]


def test_a_failed_reward_leaves_its_key_group():
    fn = _fn(CENTERED, "baseline centered(group_by=role)")
    r = R.clone()
    r[1] = float("nan")  # a failed reward: a's mean is over rows 0 and 4 only
    out = fn.advantages(r, 2, M, group_keys=KEYS)[:, 0]
    assert [round(float(out[i]), 6) for i in (0, 4)] == [-2.0, 2.0]


@pytest.mark.parametrize("use,message", [
    ("baseline centered(group_by=3)", "group_by takes the name of a data field"),
    ("trust_region clipped(group_by=role)", "group_by groups rows in the advantage stage; trust_region runs in loss()"),
    ("baseline flat(group_by=role)", "define flat calls none"),
])
def test_group_by_on_a_formula_is_checked_at_its_place(use, message):
    defines = CENTERED + "\n  define clipped\n    w = min(rho, 1.2)\n  end\n  define flat\n    b = r / 2\n  end"
    text = f'algorithm bad\n  "x"\n{defines}\n  {use}\n  objective reinforce\n'
    with pytest.raises((SpecError, SpecErrors)) as e:
        rldsl.loads(text, filename="bad.rl")
    assert message in str(e.value) and "bad.rl:" in str(e.value)
