"""The trainer side in the calling process (no Ray): one
:class:`~rldsl.runtime.train.trainer.Trainer` -- policy, reference, critic, optimizers."""
from __future__ import annotations

from typing import Any, Iterable

import torch

import rldsl

from ..batch import RolloutBatch
from ..config import RunConfig
from ..models.lora import LoraAdapter, adapter_of, merged_weights
from ..recipe import trainable
from ..records.checkpoint import Checkpoint, load_weights
from ..train.trainer import TrainBatch, Trainer
from .base import TrainerState


class LocalTrainers:
    """One :class:`Trainer` (policy, reference, critic, optimizers) in this process."""

    world_size = 1

    def __init__(self, trainer: Trainer, adapter_sync: bool = False):
        self.trainer = trainer
        self.adapter_sync = adapter_sync  # model.lora.sync = "adapter": weights() gives the adapters alone

    @classmethod
    def from_config(cls, cfg: RunConfig, fn: rldsl.CompiledAlgorithm, policy: torch.nn.Module,
                    tokenizer: Any = None) -> "LocalTrainers":
        """The trainer of ``policy`` (the master weights): LoRA adapters and gradient checkpointing
        as the config asks (``recipe.trainable``), the reference, critic and optimizers."""
        policy, reference_off = trainable(cfg, policy, checkpointing=cfg.train.gradient_checkpointing)
        return cls(Trainer.from_config(cfg, fn, policy, reference_off=reference_off, tokenizer=tokenizer),
                   adapter_sync=bool(cfg.model.lora.rank) and cfg.model.lora.sync == "adapter")

    @property
    def policy(self) -> torch.nn.Module:
        return self.trainer.policy

    def estimate(self, rollout: RolloutBatch, rewards: torch.Tensor) -> TrainBatch:
        # engines hand back CPU tensors; the trainer works where the policy lives (a GPU, say)
        device = next(self.trainer.policy.parameters()).device
        return self.trainer.estimate(rollout.to(device), rewards.to(device))

    def update(self, estimated: TrainBatch, seed: int) -> dict[str, float]:
        m = self.trainer.update(estimated, torch.Generator().manual_seed(seed))
        self.trainer.step_schedule()
        return m

    @property
    def lr(self) -> float:
        return float(self.trainer.optimizer.param_groups[0]["lr"])

    def weights(self) -> Iterable[tuple[str, torch.Tensor]] | LoraAdapter:
        if self.adapter_sync:  # the adapters alone, copied (a snapshot)
            adapter = adapter_of(self.policy)
            self.sync_bytes = adapter.nbytes  # sync/bytes
            return adapter
        merged = merged_weights(self.policy)  # LoRA merged
        self.sync_bytes = sum(v.numel() * v.element_size() for v in merged.values())  # sync/bytes
        return ((k, v.detach()) for k, v in merged.items())

    def checkpoint_state(self) -> TrainerState:
        t = self.trainer
        return TrainerState(t.policy, t.optimizer, t.scheduler, t.critic, t.critic_optimizer,
                            t.fn.state_dict(), t.teacher_state(),
                            t.loss_scaler.state_dict() if t.loss_scaler is not None else None)

    def load_checkpoint(self, c: Checkpoint) -> None:
        t = self.trainer
        load_weights(t.policy, c.policy_path)
        if t.critic is not None and c.critic_path is not None:
            load_weights(t.critic, c.critic_path)
        t.fn.load_state_dict(c.extra.get("algorithm", {}))
        t.load_teacher_state(c.extra.get("teacher_ema"))  # teacher.ema: its weights (after the policy's)
        if t.loss_scaler is not None and c.extra.get("loss_scale") is not None:  # float16
            t.loss_scaler.load_state_dict(c.extra["loss_scale"])
        c.restore(optimizer=t.optimizer, scheduler=t.scheduler, critic_optimizer=t.critic_optimizer,
                  rng=False)

    def close(self) -> None:
        """Stop the teacher's own actor, if it has one (``teacher.actor``)."""
        close = getattr(self.trainer.teacher, "close", None)
        if callable(close):
            close()
