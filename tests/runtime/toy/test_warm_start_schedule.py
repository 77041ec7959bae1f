"""toy/warmup.py WarmStartSchedule: the one optimizer and learning rate of the addition and the
arithmetic warm starts -- warm-up, constant, then from the step the teacher's mode is learned a
linear decay to 0, and the warm start ends when it reaches 0."""
from __future__ import annotations

import pytest
import torch

from rldsl.runtime.toy.warmup import WarmStartSchedule


def test_the_rate_warms_up_holds_then_decays_once_learned():
    model = torch.nn.Linear(2, 1)
    s = WarmStartSchedule(model, lr=0.1, warmup_steps=4, settle_steps=10)
    assert [s.factor(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)  # step 0's rate, set at construction
    assert s.learned(20, max_steps=25) == 25 and s.learned(20, max_steps=100) == 30  # settle_steps more
    assert [s.factor(i) for i in (20, 25, 30, 40)] == [1.0, 0.5, 0.0, 0.0]
    s.step(model(torch.ones(1, 2)).sum())
    assert model.weight.grad is not None and s.scheduler.last_epoch == 1
