"""``sampling tree`` (runtime/rollout/tree.py): answers forked at their highest -log pi tokens on
the HF engine, every generation a row holding its whole path; a run of
algorithms/examples/treerl.rl trains on them and records each leaf's fork point in
samples.jsonl; what the sampler does not run on is refused by name before a model loads."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

import rldsl
from rldsl.compiled import TreePlan
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.resolve import check_settings
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.rollout.tree import Fork, check_forks, sample_tree
from rldsl.runtime.run import loop
from small_run import small_run, steps_of

REPO = Path(__file__).resolve().parents[3]
SPEC = str(REPO / "algorithms" / "examples" / "treerl.rl")
PROMPTS = ["1+2=", "33+44="]


def test_a_tree_forks_each_answer_at_its_least_likely_tokens(tokenizer, tiny_model_factory) -> None:
    engine = HFEngine(copy.deepcopy(tiny_model_factory(tokenizer, seed=0)), tokenizer)
    shape = TreePlan(M=2, N=2, L=1, T=2)
    params = SamplingParams(n=shape.rows, temperature=1.0, max_new_tokens=8, seed=3)
    batch = sample_tree(engine, PROMPTS, params, shape)
    G = shape.rows
    assert G == 10 and len(batch) == 2 * G and batch.group_size == G and len(batch.tree) == 2 * G
    lengths = batch.response_mask.sum(-1).tolist()
    assert max(lengths) <= 8
    for p in range(2):
        rows = range(p * G, (p + 1) * G)
        forks = [Fork(*batch.tree[i]) for i in rows]
        check_forks(forks)
        assert [f.parent for f in forks[:2]] == [-1, -1]  # M answers from the prompt, then the forks
        assert all(f.parent in (0, 1) for f in forks[2:])  # L = 1: forks of the answers only
        for m in (0, 1):  # each answer: N fork points, each sampled T times
            mine = [f for f in forks if f.parent == m]
            assert len(mine) == 4 and len({f.split for f in mine}) <= 2
            # the fork points are the answer's tokens of highest -log pi
            a = p * G + m
            own = batch.logprobs[a, :lengths[a]]
            worst = sorted(range(lengths[a]), key=lambda t: (float(own[t]), t))[:2]
            assert sorted({f.split for f in mine}) == sorted(set(worst))
        for i, f in zip(rows, forks):
            assert batch.prompts[i] == PROMPTS[p]
            if f.parent == -1:
                continue
            parent = p * G + f.parent
            # a fork holds its whole path: the parent's tokens (and their logprobs) before its split
            assert torch.equal(batch.response_ids[i, :f.split], batch.response_ids[parent, :f.split])
            assert torch.equal(batch.logprobs[i, :f.split], batch.logprobs[parent, :f.split])
    # seeded: the same tree again
    again = sample_tree(engine, PROMPTS, params, shape)
    assert torch.equal(again.response_ids, batch.response_ids) and again.tree == batch.tree


def test_a_tree_of_two_iterations_forks_the_forks(tokenizer, tiny_model_factory) -> None:
    engine = HFEngine(copy.deepcopy(tiny_model_factory(tokenizer, seed=0)), tokenizer)
    shape = TreePlan(M=1, N=1, L=2, T=2)
    batch = sample_tree(engine, ["5+5="], SamplingParams(n=shape.rows, max_new_tokens=10, seed=1), shape)
    assert len(batch) == 5
    forks = [Fork(*t) for t in batch.tree]
    check_forks(forks)
    # the second iteration's fork point is the tree's least likely token among all its generations
    second = forks[3]
    assert forks[4] == second
    lengths = batch.response_mask.sum(-1).tolist()
    own = [(float(batch.logprobs[g, t]), g, t) for g in range(3) for t in range(forks[g].split, lengths[g])]
    lowest = min(own)
    assert (second.parent, second.split) == (lowest[1], lowest[2])


def test_the_sampler_refuses_a_call_of_another_size(tokenizer, tiny_model_factory) -> None:
    engine = HFEngine(copy.deepcopy(tiny_model_factory(tokenizer, seed=0)), tokenizer)
    with pytest.raises(ValueError, match="makes 4 rows per prompt; the call asks for 8"):
        sample_tree(engine, PROMPTS, SamplingParams(n=8, max_new_tokens=4), TreePlan(1, 1, 1, 3))


@pytest.mark.slow
def test_a_treerl_run_trains_on_its_trees(model_dir, tmp_path) -> None:
    """treerl.rl's sampling tree(M=2, N=1, L=1, T=1): 4 leaves per prompt, 2 prompts, 2 steps."""
    cfg = small_run(model_dir, tmp_path / "run", **{"rollout.n": 4, "rollout.prompts_per_step": 2,
                                                    "rollout.max_new_tokens": 6, "train.steps": 2,
                                                    "log.samples_per_step": 2})
    run = loop.train(SPEC, cfg)
    steps = steps_of(run)
    assert len(steps) == 2
    assert all(math.isfinite(s["loss"]) for s in steps)
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 4
    for step in (1, 2):
        for group in (0, 1):
            g = [r for r in rows if r["step"] == step and r["group"] == group]
            trees = [r["tree"] for r in g]
            assert [t["parent"] for t in trees] == [-1, -1, 0, 1]
            check_forks([Fork(t["parent"], t["split"]) for t in trees])
            for r, t in zip(g[2:], trees[2:]):  # a fork holds its parent's tokens before its split
                assert t["split"] < g[t["parent"]]["response_length"]
                assert r["response_length"] > t["split"]


def _check(spec: str, **sets: object) -> None:
    cfg = small_run(Path("/nonexistent-model"), Path("/nonexistent-out"), **sets)
    check_settings(rldsl.loads(Path(spec).read_text() if Path(spec).exists() else spec, filename="t.rl"), cfg)


@pytest.mark.parametrize(("sets", "message"), [
    ({"rollout.engine": "vllm"}, "not yet with rollout.engine=vllm"),
    ({"rollout.max_staleness": 1}, "not yet with rollout.max_staleness > 0"),
    ({"distributed.rollout_workers": 2}, "not yet with Ray workers"),
    ({"rollout.n": 8}, r"makes M \(1 \+ L N T\) = 4 rows \(leaves\) per prompt: set rollout.n=4 \(it is 8\)"),
])
def test_what_the_tree_sampler_does_not_run_on_is_refused_by_name(sets: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _check(SPEC, **{"rollout.n": 4, **sets})


def test_a_spec_reading_the_tree_without_a_tree_is_refused() -> None:
    text = Path(SPEC).read_text().replace("  sampling      tree(M=2, N=1, L=1, T=1)\n", "")
    with pytest.raises(ConfigError, match="reads node_value, parent_value, root_value, node_leaves, "
                                          "parent_leaves, which only a tree's rows have"):
        _check(text, **{"rollout.n": 4})


def test_the_tree_inputs_of_a_batch_with_a_failed_reward(tokenizer, tiny_model_factory) -> None:
    """A failed reward (NaN) reads its group's mean finite reward in the tree's means: every input
    stays finite (estimate() takes the row itself out of the loss), per group of the batch."""
    from types import SimpleNamespace

    from rldsl.runtime.rollout.tree import tree_inputs
    from rldsl.runtime.train.inputs import tree_values

    engine = HFEngine(copy.deepcopy(tiny_model_factory(tokenizer, seed=0)), tokenizer)
    shape = TreePlan(M=2, N=1, L=1, T=1)
    batch = sample_tree(engine, PROMPTS, SamplingParams(n=4, max_new_tokens=6, seed=2), shape)
    rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    made, _ = tree_values(None, batch, SimpleNamespace(rewards=rewards), [])
    T = batch.response_ids.shape[1]
    assert all(bool(torch.isfinite(made.inputs[k]).all()) for k in ("node_value", "root_value"))
    want = tree_inputs([Fork(*f) for f in batch.tree[:4]], torch.tensor([1.0, 2 / 3, 0.0, 1.0]), T)
    for k, v in want.items():
        torch.testing.assert_close(made.inputs[k][:4].double(), v, rtol=0, atol=1e-6)
    assert made.inputs["root_value"][4:].tolist() == [0.5] * 4  # the second prompt's own leaves
