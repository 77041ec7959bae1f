"""Token-budget micro-batches (train/microbatch.py): packing, trimming, and the exactness of
the update -- loss, gradients and parameters after a step equal the whole-minibatch ones."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import rldsl
from rldsl.runtime.config import RunConfig
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.logprobs import Forward, token_logprobs
from rldsl.runtime.batch import model_inputs
from rldsl.runtime.train.microbatch import pack, plan, rank_groups, row_tokens, trim
from rldsl.runtime.train.trainer import Trainer

ALGOS = Path(__file__).parents[3] / "algorithms"
PROMPTS = ["1+2=", "33+44=", "(5)*6-7=", "9=", "12*3=", "7-1="]  # different lengths


def test_pack_respects_budget_and_balances() -> None:
    sizes = [30, 10, 25, 5, 40, 20, 15]
    bins = pack(sizes, 50)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in b) for b in bins]
    assert max(loads) <= 50
    assert len(bins) == 3  # ceil(145 / 50)
    assert max(loads) - min(loads) <= 15


def test_pack_oversized_unit_gets_its_own_bin_and_min_bins() -> None:
    bins = pack([100, 10, 10], 50)
    assert [0] in bins and sorted(i for b in bins for i in b) == [0, 1, 2]
    assert len(pack([5, 5], 100, min_bins=4)) == 4  # padding bins for other ranks
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        pack([1], 0)


def _rollout(model, tokenizer, G=4, seed=3):
    return HFEngine(model, tokenizer).generate(
        PROMPTS, SamplingParams(n=G, temperature=1.5, max_new_tokens=8, seed=seed))


def test_plan_whole_groups_or_rows(tiny_model, tokenizer) -> None:
    batch = _rollout(tiny_model, tokenizer)
    tok = row_tokens(batch)
    G = batch.group_size
    rows, by_group = plan(batch, 10_000, whole_groups=False)
    assert by_group and len(rows) == 1
    budget = int(tok.view(-1, G).sum(1).max())  # every group fits
    rows, by_group = plan(batch, budget, whole_groups=False)
    assert by_group and all(len(r) % G == 0 for r in rows)
    assert all(int(tok[r].sum()) <= budget for r in rows)
    rows, by_group = plan(batch, budget - 1, whole_groups=False)  # some group does not fit
    assert not by_group and all(int(tok[r].sum()) <= budget - 1 for r in rows)
    assert sorted(torch.cat(rows).tolist()) == list(range(len(batch)))


def test_trim_drops_only_padding(tiny_model, tokenizer) -> None:
    batch = _rollout(tiny_model, tokenizer).select(torch.tensor([0, 1, 2, 3]))  # one short prompt
    small, tr = trim(batch)
    assert small.prompt_ids.shape[1] < batch.prompt_ids.shape[1]
    Tr = batch.response_ids.shape[1]
    with torch.no_grad():
        full = token_logprobs(tiny_model, Forward(*model_inputs(batch)[:2], Tr)).logprobs
        part = token_logprobs(tiny_model, Forward(*model_inputs(small)[:2], tr)).logprobs
    m = batch.response_mask[:, :tr].bool()
    torch.testing.assert_close(part[m], full[:, :tr][m], atol=1e-5, rtol=0)


def _trainer(spec: str, model, budget, dtype):
    cfg = RunConfig()
    cfg.train.ppo_epochs = 2  # old logprobs recomputed (micro-batched too), two steps
    cfg.train.minibatches = 2
    cfg.train.max_tokens_per_microbatch = budget
    cfg.train.skip_zero_advantage = False
    cfg.train.lr = 1e-2
    fn = rldsl.compile(rldsl.load(str(ALGOS / f"{spec}.rl")), compile=False)
    t = Trainer.from_config(cfg, fn, model)
    # SGD: parameters move by lr x gradient. (Adam's first steps are ~lr x sign(g), which
    # turns fp32-rounding noise of near-zero gradients into lr-sized differences.)
    t.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if t.critic is not None:
        t.critic.to(dtype)
        t.critic_optimizer = torch.optim.SGD(t.critic.parameters(), lr=0.1)
    return t


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
@pytest.mark.parametrize("spec", ["lite_ppo", "grpo", "scalerl", "ppo"])
def test_microbatched_update_equals_whole_minibatch(tiny_model, tokenizer, spec, dtype, tol) -> None:
    """token_mean (lite_ppo), seq_mean_token_mean + reference KL (grpo), prompt_mean
    (scalerl) and a critic (ppo): same loss, gradients and parameters under a budget."""
    batch = _rollout(tiny_model, tokenizer)
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(batch))])
    tok = row_tokens(batch)
    results = []
    for budget in (None, int(tok.max()) + 2):  # ~2 rows per micro-batch
        torch.manual_seed(0)
        model = copy.deepcopy(tiny_model).to(dtype)
        t = _trainer(spec, model, budget, dtype)
        if t.critic is not None:  # a critic that is not all zeros
            torch.manual_seed(1)
            torch.nn.init.normal_(t.critic.head.weight, std=0.1)
        est = t.estimate(batch, rewards)
        m = t.update(est, torch.Generator().manual_seed(0))
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        if t.critic is not None:
            grads += [p.grad.clone() for p in t.critic.parameters() if p.grad is not None]
        params = [p.detach().clone() for p in model.parameters()]
        results.append((est, m, grads, params))
    (e0, m0, g0, p0), (e1, m1, g1, p1) = results
    assert m0["optimizer_steps"] == m1["optimizer_steps"] == 4
    for name in ("old_logprobs", "ref_logprobs", "old_values", "advantages"):
        a, b = getattr(e0, name), getattr(e1, name)
        assert (a is None) == (b is None), name
        if a is not None:
            mk = e0.mask > 0
            torch.testing.assert_close(b[mk], a[mk], atol=tol, rtol=0, msg=name)
    for k in ("loss", "pg_loss", "grad_norm", "clip_fraction"):
        if k in m0:
            assert m1[k] == pytest.approx(m0[k], abs=tol * 10), k
    assert len(g0) == len(g1) > 0
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=tol, rtol=0)
    for a, b in zip(p0, p1):
        torch.testing.assert_close(b, a, atol=tol, rtol=0)


def test_rank_groups_balance_real_tokens() -> None:
    """Long-tailed groups over 3 ranks: every group on exactly one rank, the largest rank's
    tokens within the largest group of the mean (LPT), the same answer every time."""
    load = [400, 30, 35, 20, 250, 40, 25, 60, 33, 90]
    ranks = rank_groups(load, 3)
    assert sorted(g for r in ranks for g in r) == list(range(len(load)))
    totals = [sum(load[g] for g in r) for r in ranks]
    assert max(totals) == 400 and max(totals) / (sum(totals) / 3) < 1.25  # contiguous thirds: 685 / 328
    assert rank_groups(load, 3) == ranks
    assert rank_groups([5, 6], 3)[2] == []  # fewer groups than ranks: one rank gets none
