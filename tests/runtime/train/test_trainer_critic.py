"""The critic in the trainer: its own aggregation count, and the policy's LR schedule."""
from __future__ import annotations

import warnings

import pytest
import torch

import rldsl
from rldsl.runtime.config import load_config
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.trainer import Trainer


@pytest.fixture
def ppo_trainer(tiny_model_factory, tokenizer):
    cfg = load_config(None, ["train.lr=1e-3", "train.critic_lr=4e-3", "train.warmup_steps=3",
                             "train.steps=6"])
    fn = rldsl.compile(rldsl.load("ppo"), compile=False)
    return cfg, fn, Trainer.from_config(cfg, fn, tiny_model_factory(tokenizer))


def test_critic_lr_follows_the_policy_schedule(ppo_trainer):
    cfg, fn, trainer = ppo_trainer
    policy, critic = [], []
    for _ in range(6):
        policy.append(trainer.optimizer.param_groups[0]["lr"])
        critic.append(trainer.critic_optimizer.param_groups[0]["lr"])
        trainer.step_schedule()
    assert policy[0] < policy[1] < policy[2]  # warm-up
    assert critic == pytest.approx([4 * p for p in policy], rel=1e-12)


def test_a_schedule_over_skipped_updates_prints_no_torch_warning(ppo_trainer):
    """The schedule advances on a skipped update (zero advantages, a float16 overflow); torch's "Detected
    call of `lr_scheduler.step()` before `optimizer.step()`" leaked to every such run's console: its
    filter was an unescaped regular expression that never matched."""
    _cfg, _fn, trainer = ppo_trainer
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.step_schedule()
    assert [str(w.message) for w in seen] == []


def test_value_loss_gets_the_critics_global_count(ppo_trainer, tokenizer, monkeypatch):
    """ppo aggregates the policy loss per sequence; the critic defaults to token_mean."""
    cfg, fn, trainer = ppo_trainer
    engine = HFEngine(trainer.policy, tokenizer)
    rollout = engine.generate(["1+2=", "12+3="], SamplingParams(n=4, max_new_tokens=5, seed=0))
    batch = trainer.estimate(rollout, torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0]))
    seen = {}
    real = fn.loss

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fn, "loss", spy)
    trainer.update(batch)
    assert float(seen["value_denominator"]) == float(batch.mask.sum())  # every valid token
    assert float(seen["denominator"]) == float(fn.denominator(batch.mask, 4))
    assert float(seen["denominator"]) != float(seen["value_denominator"])
