"""The trainer with per-term aggregation (a per-sequence policy term beside a token-mean KL term,
`kl k3(..., aggregation=token_mean)`): its [2] denominator is summed per term over micro-batches,
so an update under a token budget (~2 rows per micro-batch) equals the whole-minibatch update."""
from __future__ import annotations

import copy

import pytest
import torch

import rldsl
from rldsl.runtime.config import RunConfig
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.microbatch import row_tokens
from rldsl.runtime.train.trainer import Trainer

SPEC = ("algorithm per_term extends grpo\n"
        "  kl           k3(beta=0.1, where=loss, aggregation=token_mean)\n"
        "  aggregation  seq_mean_token_mean\n")
PROMPTS = ["1+2=", "33+44=", "(5)*6-7=", "9="]  # different lengths


def _update(model, batch, rewards, budget):
    cfg = RunConfig()
    cfg.train.minibatches = 1
    cfg.train.max_tokens_per_microbatch = budget
    cfg.train.skip_zero_advantage = False
    t = Trainer.from_config(cfg, rldsl.compile(rldsl.loads(SPEC), compile=False), model)
    t.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the policy moved off its reference copy: a KL term with a gradient
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    m = t.update(t.estimate(batch, rewards), torch.Generator().manual_seed(0))
    return m, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_micro_batched_update_with_per_term_aggregation_equals_the_whole_one(tiny_model, tokenizer) -> None:
    batch = HFEngine(tiny_model, tokenizer).generate(
        PROMPTS, SamplingParams(n=4, temperature=1.5, max_new_tokens=8, seed=3))
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(batch))])
    out = []
    for budget in (None, int(row_tokens(batch).max()) + 2):
        torch.manual_seed(0)
        out.append(_update(copy.deepcopy(tiny_model).to(torch.float64), batch, rewards, budget))
    (m0, g0), (m1, g1) = out
    assert m0["kl"] > 1e-4  # the KL term is there to aggregate
    for k in ("loss", "pg_loss", "kl", "grad_norm"):
        assert m1[k] == pytest.approx(m0[k], abs=1e-6), k
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-7, rtol=1e-6)
