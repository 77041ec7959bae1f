"""The learning-rate schedule and the optimizer built from ``[train]``."""
from __future__ import annotations

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
