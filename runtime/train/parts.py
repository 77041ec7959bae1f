"""A run's trainer, from its config: the parts ``Trainer.from_config`` hands the constructor.

The reference copy (none under LoRA: adapters off), the critic, the run's teacher, the AdamW
optimizers and the LR schedule the critic follows, and the settings of the forwards: the
LM head's chunk (``train.logits_chunk``), the scoring temperature, autocast (and float16's loss
scaler, train/loss_scale.py), packing.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

from torch import nn

from rldsl import CompiledAlgorithm

from ..config import RunConfig
from ..models.loading import autocast_dtype
from .loss_scale import loss_scaler
from .optim import build_optimizer, build_scheduler, lr_factor
from .teachers import teacher_of
from .value_model import ValueModel


def logits_chunk(cfg: RunConfig) -> int:
    """Tokens per LM-head chunk (``train.logits_chunk``): 1024 by default, 256 under gradient
    checkpointing -- there the blocks keep almost nothing and the chunk's two [C, V] float32
    buffers are a large part of what is left (bench/README.md, ``bench/memory.py``)."""
    t = cfg.train
    if t.logits_chunk is not None:
        return t.logits_chunk
    return 256 if t.gradient_checkpointing or cfg.distributed.activation_checkpointing else 1024


def scoring_temperature(rollout_temperature: float) -> float:
    """The temperature the trainer scores a rollout at: the sampling one, 1 for greedy (T = 0)."""
    return float(rollout_temperature) if rollout_temperature > 0 else 1.0


def trainer_parts(cfg: RunConfig, fn: CompiledAlgorithm, policy: nn.Module, *,
                  prepare: Callable[[nn.Module, nn.Module | None, nn.Module | None], None] | None = None,
                  reference_off: Callable[[], Any] | None = None, tokenizer: Any = None,
                  teacher: bool = True) -> dict[str, Any]:
    """The trainer constructor's keyword arguments for ``policy`` in a run (``Trainer.from_config``).

    A spec that reads a teacher gets the run's (train/teachers.py ``teacher_of``; ``tokenizer``,
    the policy's, checks a teacher server's) unless ``teacher`` is False (the caller gives its
    own); then the reference copy (none with ``reference_off``) and the critic are made,
    ``prepare(policy, reference, critic)`` runs, and the optimizers are built.
    """
    algo = fn.algorithm
    out: dict[str, Any] = {}
    reference = None
    if algo.uses_teacher and teacher:
        out["teacher"] = teacher_of(cfg, policy, tokenizer, fn.data.teacher_topk or 0, logits_chunk(cfg), algo.name)
        if cfg.teacher.ema is not None:
            out["teacher_ema"] = cfg.teacher.ema
    if algo.uses_reference and reference_off is None:
        reference = copy.deepcopy(policy).eval()
        for p in reference.parameters():
            p.requires_grad_(False)
    critic = critic_opt = None
    if algo.uses_critic:
        critic = ValueModel(policy).to(cfg.device)
    if prepare is not None:
        prepare(policy, reference, critic)
    t = cfg.train
    if critic is not None:
        critic_opt = build_optimizer(critic.parameters(), t, lr=t.critic_lr or t.lr)
    optimizer = build_optimizer([p for p in policy.parameters() if p.requires_grad], t)
    return dict(optimizer=optimizer, scheduler=build_scheduler(optimizer, t),
                reference=reference, critic=critic, critic_optimizer=critic_opt,
                ppo_epochs=t.ppo_epochs, minibatches=t.minibatches, grad_clip=t.grad_clip,
                skip_zero_advantage=t.skip_zero_advantage,
                temperature=scoring_temperature(cfg.rollout.temperature),
                critic_lr_factor=(lambda step: lr_factor(step, t)) if critic_opt is not None else None,
                max_tokens_per_microbatch=t.max_tokens_per_microbatch,
                logprob_chunk=logits_chunk(cfg),
                autocast_dtype=autocast_dtype(cfg.model.dtype), loss_scaler=loss_scaler(autocast_dtype(cfg.model.dtype)),
                reference_off=reference_off,
                packing=t.packing, packing_row_tokens=t.packing_row_tokens,
                compile_policy=cfg.model.compile,
                routing_replay=cfg.rollout.routing_replay,  # a MoE policy's forwards replay the engine's experts
                **out)
