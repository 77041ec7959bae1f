"""The optimizer (AdamW) and the learning-rate schedule of a run, built from ``[train]``."""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from ..config import TrainConfig


def lr_factor(step: int, train: TrainConfig) -> float:
    """Multiplier of ``train.lr`` at 0-based training step ``step``.

    Warm-up: ``(step + 1) / warmup_steps`` for ``step < warmup_steps``. Then, with
    ``p = (step - warmup) / (steps - warmup)`` clamped to [0, 1] and ``m = min_lr_ratio``:
    1 (``constant``), ``m + (1 - m) * (1 - p)`` (``linear``: with m = 0 after the warm-up it is
    transformers' ``get_linear_schedule_with_warmup``, TRL's default), or
    ``m + (1 - m) * (1 + cos(pi * p)) / 2`` (``cosine``).
    """
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.lr_schedule == "constant":
        return 1.0
    span = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, max(0.0, (step - train.warmup_steps) / span))
    if train.lr_schedule == "linear":
        return train.min_lr_ratio + (1.0 - train.min_lr_ratio) * (1.0 - progress)
    return train.min_lr_ratio + (1.0 - train.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[Any], train: TrainConfig, lr: float | None = None) -> torch.optim.AdamW:
    """AdamW over ``params`` with the config's lr (or ``lr``), betas, eps, weight decay.

    The fused kernel (one pass over every tensor, as TRL's default ``adamw_torch_fused``) where
    torch has it for these parameters (CPU and CUDA, floating dtypes, FSDP2's DTensors too);
    else torch's default implementation. The same algorithm: the weights agree to float
    rounding (~1e-7 after 30 steps), and on the tiny model the optimizer step takes 0.5 ms
    instead of 2.1 (bench/README.md, "The step's own overhead")."""
    params = list(params)
    kwargs = dict(lr=train.lr if lr is None else lr, betas=train.betas, eps=train.eps,
                  weight_decay=train.weight_decay)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except RuntimeError:  # a device or dtype the fused kernel does not take
        return torch.optim.AdamW(params, **kwargs)


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR following :func:`lr_factor`; call ``.step()`` once per training step."""

    def factor(step: int) -> float:
        return lr_factor(step, train)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
