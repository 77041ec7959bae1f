"""`correction bypass` (verl rollout_correction.bypass_mode): pi_old is the engine's logprobs. The
trainer skips its old-logprob forward, and with the HF engine (whose logprobs are exact) the update
equals the one that recomputes pi_old, to 1e-6 in float64."""
from __future__ import annotations

import copy

import pytest
import torch

import rldsl
from rldsl.runtime.config import RunConfig
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.packing import packing_supported, shared_packing_supported
from rldsl.runtime.train.trainer import Trainer

PROMPTS = ["1+2=", "33+44=", "(5)*6-7=", "9="]
BASE = """algorithm b extends grpo
  "GRPO without KL{extra}"
  kl            none
"""


def _spec(bypass: bool) -> rldsl.CompiledAlgorithm:
    text = BASE.format(extra=", old policy = rollout policy" if bypass else "")
    if bypass:
        text += "  correction    bypass\n"
    return rldsl.compile(rldsl.loads(text, filename="b.rl"), compile=False)


def _trainer(fn, model) -> Trainer:
    cfg = RunConfig()
    cfg.rollout.temperature = 1.0
    cfg.train.ppo_epochs = 2  # several updates per rollout: pi_old is needed (recomputed or not)
    cfg.train.minibatches = 2
    cfg.train.skip_zero_advantage = False
    t = Trainer.from_config(cfg, fn, model)
    t.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return t


class ForwardCounter:
    def __init__(self, model):
        self.n = 0
        packing_supported(model.get_decoder())  # train.packing's one-off checks of the model, not counted
        shared_packing_supported(model.get_decoder())
        model.get_decoder().register_forward_hook(self)  # token_logprobs runs the decoder, then lm_head in chunks

    def __call__(self, *args):
        self.n += 1


@pytest.fixture()
def rollout64(tiny_model, tokenizer):
    model = copy.deepcopy(tiny_model).to(torch.float64)
    batch = HFEngine(model, tokenizer).generate(
        PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=5))
    return model, batch


def test_bypass_skips_the_old_logprob_forward_and_equals_the_recomputed_step(rollout64):
    model0, batch = rollout64
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(batch))])
    res = {}
    for bypass in (False, True):
        model = copy.deepcopy(model0)
        t = _trainer(_spec(bypass), model)
        count = ForwardCounter(model)
        est = t.estimate(batch, rewards)
        n_estimate = count.n
        m = t.update(est, torch.Generator().manual_seed(0))
        res[bypass] = (n_estimate, count.n - n_estimate, est, m, [p.detach().clone() for p in model.parameters()])
    (n0, u0, e0, m0, p0), (n1, u1, e1, m1, p1) = res[False], res[True]
    assert n0 >= 1 and n1 == 0  # the old-logprob pass is gone, nothing else runs in estimate()
    assert u0 == u1 > 0         # the updates run the same forwards
    assert e0.old_logprobs is not None and e1.old_logprobs is None
    valid = batch.response_mask > 0
    # the engine's logprobs are exact (kept in float32): the recomputed pi_old equals them
    assert (e0.old_logprobs - batch.logprobs.to(e0.old_logprobs.dtype)).abs()[valid].max() < 1e-6
    assert m0["optimizer_steps"] == m1["optimizer_steps"] == 4
    for k in ("loss", "pg_loss", "clip_fraction", "ratio_max", "grad_norm"):
        assert m1[k] == pytest.approx(m0[k], abs=1e-6), k
    assert m0["ratio_max"] > 1.0  # the second epoch's ratio moved: pi_old mattered
    for a, b in zip(p0, p1):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


def test_bypass_reads_the_engine_logprobs_in_the_loss():
    """fn.loss: old_logprobs are replaced by rollout_logprobs (NaN: the given ones)."""
    g = torch.Generator().manual_seed(0)
    B, T = 4, 5
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) - 0.1
    roll = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    junk = logp - 5.0  # what a non-bypass spec would take as pi_old
    mask = torch.ones(B, T, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    fn, plain = _spec(True), _spec(False)
    ours = fn.loss(logp, junk, adv, mask, rollout_logprobs=roll)
    assert ours.loss.item() == pytest.approx(plain.loss(logp, roll, adv, mask).loss.item(), abs=1e-12)
    roll_nan = roll.clone()
    roll_nan[0, :2] = float("nan")
    half = fn.loss(logp, logp, adv, mask, rollout_logprobs=roll_nan)
    old = torch.where(torch.isnan(roll_nan), logp, roll_nan)
    assert half.loss.item() == pytest.approx(plain.loss(logp, old, adv, mask).loss.item(), abs=1e-12)
