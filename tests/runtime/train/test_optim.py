"""The learning-rate schedule and the optimizer built from ``[train]``."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from rldsl.runtime.config import TrainConfig
from rldsl.runtime.train.optim import build_optimizer, build_scheduler, lr_factor


def test_lr_factor_constant_with_warmup():
    train = TrainConfig(steps=10, warmup_steps=4)
    assert [lr_factor(s, train) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_lr_factor_cosine():
    train = TrainConfig(steps=12, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.2)
    assert lr_factor(0, train) == 0.5
    assert lr_factor(2, train) == pytest.approx(1.0)
    assert lr_factor(7, train) == pytest.approx(0.6)     # halfway: 0.2 + 0.8 * 0.5
    assert lr_factor(12, train) == pytest.approx(0.2)
    assert lr_factor(50, train) == pytest.approx(0.2)    # clamped past the end
    p = 1 / 10
    assert lr_factor(3, train) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * p)))


def test_lr_factor_linear():
    train = TrainConfig(steps=10, warmup_steps=2, lr_schedule="linear")
    assert [lr_factor(s, train) for s in range(11)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0])
    floor = TrainConfig(steps=10, warmup_steps=0, lr_schedule="linear", min_lr_ratio=0.2)
    assert [lr_factor(s, floor) for s in (0, 5, 10, 20)] == pytest.approx([1.0, 0.6, 0.2, 0.2])


def test_lr_factor_linear_is_transformers_linear_schedule_after_the_warmup():
    """TRL's default schedule: transformers' get_linear_schedule_with_warmup (whose warm-up starts at
    0/W where ours starts at 1/W: the same from the first step after the warm-up on)."""
    from transformers import get_linear_schedule_with_warmup
    steps, warmup = 17, 3
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_linear_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=steps)
    train = TrainConfig(steps=steps, warmup_steps=warmup, lr_schedule="linear")
    for s in range(steps):
        if s >= warmup:
            assert lr_factor(s, train) == pytest.approx(theirs.lr_lambdas[0](s), abs=1e-12), s


def test_optimizer_and_scheduler_follow_the_config():
    train = TrainConfig(lr=0.1, betas=(0.8, 0.9), weight_decay=0.01, warmup_steps=2,
                        steps=4, lr_schedule="cosine")
    param = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([param], train)
    group = opt.param_groups[0]
    assert (group["betas"], group["weight_decay"], group["eps"]) == ((0.8, 0.9), 0.01, 1e-8)
    sched = build_scheduler(opt, train)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.05], abs=1e-12)


def _adam_steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_the_optimizer_is_fused_adamw_with_torchs_default_results() -> None:
    """TRL's default kernel (adamw_torch_fused) where torch has it; the same algorithm as torch's
    default AdamW: 30 steps of the same gradients agree to float rounding, and its state resumes."""
    train = TrainConfig(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)

    def params() -> list[torch.nn.Parameter]:
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(23, 96), (96, 384), (96,)]]

    fused, plain = params(), params()
    opt = build_optimizer(fused, train)
    assert opt.param_groups[0]["fused"] is True
    reference = torch.optim.AdamW(plain, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    _adam_steps(opt, fused, 30)
    _adam_steps(reference, plain, 30)
    moved = max((a - b).abs().max().item() for a, b in zip(fused, params()))
    diff = max((a - b).abs().max().item() for a, b in zip(fused, plain))
    assert moved > 0.1 and diff < 1e-5, (moved, diff)
    # resume: a fresh optimizer loading the state continues as the uninterrupted one
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in fused]
    resumed = build_optimizer(resumed_params, train)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # as a checkpoint's, not the live tensors
    _adam_steps(opt, fused, 3, seed=2)
    _adam_steps(resumed, resumed_params, 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(fused, resumed_params))


def test_the_optimizer_falls_back_where_the_fused_kernel_cannot_run(monkeypatch) -> None:
    real = torch.optim.AdamW

    def refuses_fused(params, fused=None, **kw):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return real(params, **kw)
    monkeypatch.setattr(torch.optim, "AdamW", refuses_fused)
    opt = build_optimizer((p for p in [torch.nn.Parameter(torch.zeros(2))]), TrainConfig(lr=0.1))
    assert not opt.param_groups[0]["fused"] and len(opt.param_groups[0]["params"]) == 1
