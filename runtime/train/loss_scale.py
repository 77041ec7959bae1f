"""Dynamic loss scaling for ``model.dtype = float16`` (torch.amp.GradScaler's rule, written for
the trainer's own step so that every trainer rank takes the same decision).

float16 has 5 exponent bits: gradients of the 16-bit activations underflow to 0 below ~6e-8
and overflow to inf above 65504. The loss is multiplied by ``scale`` before the backward, the
gradients (of the float32 master weights) are divided by it before the gradient norm is taken
and clipped; a step whose gradient norm is not finite is skipped (no optimizer step) and the
scale halved; after ``growth_interval`` finite steps in a row it is doubled. The decision reads
the clipped gradient norm, which the sharded trainer all-reduces over the ranks (FSDP2's
``clip_grad_norm_``), so every rank skips together. bfloat16 has float32's exponent range and
needs none of this (GradScaler is a no-op there too).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor


class LossScaler:
    """The scale and its update rule; GradScaler's defaults (init 2**16, x2 after 2000 finite
    steps, x0.5 on inf/nan)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0  # finite steps since the scale last changed
        self.skipped = 0     # steps skipped for an inf/nan gradient since the last ``take_skipped``

    def unscale(self, params: Iterable[Tensor]) -> None:
        """Divide the gradients of ``params`` by the scale in place (before clipping)."""
        inv = 1.0 / self.scale
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)

    def update(self, finite: bool) -> bool:
        """After a step's unscaled gradient norm: whether the optimizer may step (``finite``);
        the scale backs off on inf/nan and grows after ``growth_interval`` finite steps."""
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True

    def take_skipped(self) -> int:
        """The steps skipped since the last call (then 0)."""
        n, self.skipped = self.skipped, 0
        return n

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])


def loss_scaler(dtype: torch.dtype | None) -> LossScaler | None:
    """The trainer's loss scaler for its autocast ``dtype``: one for float16, else None."""
    return LossScaler() if dtype == torch.float16 else None
