"""A loss formula reading a ``batch_*`` statistic (``rldsl.formula.hooks.batch_wide_loss``) sees the
whole minibatch however the update is split: with 4 micro-batches the trainer gives the same loss
and the same gradients as with one (docs/formulas.md, "The batch"). The statistic here depends
on the current policy (the sorted |log pi - log pi_old| of every token of the batch)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import rldsl
from rldsl.formula import hooks
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.microbatch import plan, row_tokens
from rldsl.runtime.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]
BUDGET = ROOT / "tests" / "specs" / "formula" / "order_budget_trust_region.rl"
# a batch mean of the current policy's per-token value, inside the gradient path
BATCH_MEAN = """
algorithm batch_centered extends grpo
  "PPO with each token's ratio centred on the batch's mean ratio."
  define centered
    w = rho - batch_mean(rho) + 1
  end
  trust_region  centered
  kl            none
  aggregation   token_mean
"""
PROMPTS = ["1+2=", "33+44=", "(5)*6-7=", "9="]
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])


def _step(model, batch, algo, budget):
    """One optimizer step (the policy nudged after estimate(), so pi != pi_old): the loss and the
    gradients it applied."""
    fn = rldsl.compile(algo, compile=False)
    trainer = Trainer(fn, model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                      skip_zero_advantage=False, minibatches=1, ppo_epochs=2, max_tokens_per_microbatch=budget)
    tb = trainer.estimate(batch, REWARDS)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    grads: list[dict[str, torch.Tensor]] = []
    real = trainer.optimizer.step

    def record(*a, **k):
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return real(*a, **k)

    trainer.optimizer.step = record  # type: ignore[method-assign]
    trainer.ppo_epochs = 1
    metrics = trainer.update(tb)
    return metrics, grads[0]


@pytest.mark.parametrize("spec", ["budget", "batch_mean"])
def test_batch_statistics_of_the_loss_are_the_same_with_1_or_4_micro_batches(tiny_model, tokenizer, spec):
    algo = rldsl.load(BUDGET) if spec == "budget" else rldsl.loads(BATCH_MEAN, "batch_centered.rl")
    assert hooks.batch_wide_loss(algo.slots) == ["trust_region"]
    model = copy.deepcopy(tiny_model)
    batch = HFEngine(model, tokenizer).generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3))
    budget = int(row_tokens(batch).max()) + 1  # rows of their own: 4 micro-batches of whole groups or more
    assert len(plan(batch, budget, whole_groups=False)[0]) >= 4
    one, g_one = _step(copy.deepcopy(model), batch, algo, None)
    four, g_four = _step(copy.deepcopy(model), batch, algo, budget)
    assert four["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert g_one.keys() == g_four.keys()
    for name, g in g_one.items():
        torch.testing.assert_close(g_four[name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_several_trainer_ranks_are_accepted_before_a_model_loads():
    """Exact across ranks (tests/runtime/workers/test_ray.py): no longer refused."""
    from rldsl.runtime.config import load_config
    from rldsl.runtime.resolve import check_settings

    check_settings(rldsl.load(BUDGET), load_config(None, ["distributed.trainers=2"]))
