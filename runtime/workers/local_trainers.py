"""The trainer side in the calling process (no Ray): one
:class:`~rldsl.runtime.train.trainer.Trainer` -- policy, reference, critic, optimizers."""
from __future__ import annotations

from typing import Any

import torch

import rldsl

from ..batch import RolloutBatch
from ..config import RunConfig
from ..recipe import trainable
from ..records.checkpoint import Checkpoint, load_weights
from ..train.trainer import TrainBatch, Trainer
from .base import TrainerState
from .sync.base import EngineWeights, Kind, kind_of
from .sync.full_state import FullStateKind


class LocalTrainers:
    """One :class:`Trainer` (policy, reference, critic, optimizers) in this process."""

    world_size = 1

    def __init__(self, trainer: Trainer, sync: Kind = FullStateKind()):
        self.trainer = trainer
        self.sync = sync  # what weights() sends (sync/base.py ``kind_of``): the full state, or the LoRA adapters alone
        self.sync_bytes = 0  # the bytes of the last weights() (sync/bytes)

    @classmethod
    def from_config(cls, cfg: RunConfig, fn: rldsl.CompiledAlgorithm, policy: torch.nn.Module,
                    tokenizer: Any = None) -> "LocalTrainers":
        """The trainer of ``policy`` (the master weights): LoRA adapters and gradient checkpointing
        as the config asks (``recipe.trainable``), the reference, critic and optimizers; the weight
        sync's kind, chosen here once."""
        policy, reference_off = trainable(cfg, policy, checkpointing=cfg.train.gradient_checkpointing)
        return cls(Trainer.from_config(cfg, fn, policy, reference_off=reference_off, tokenizer=tokenizer),
                   kind_of(cfg))

    @property
    def policy(self) -> torch.nn.Module:
        return self.trainer.policy

    def estimate(self, rollout: RolloutBatch, rewards: torch.Tensor) -> TrainBatch:
        # engines hand back CPU tensors; the trainer works where the policy lives (a GPU, say)
        device = next(self.trainer.policy.parameters()).device
        return self.trainer.estimate(rollout.to(device), rewards.to(device))

    def response_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The policy's no-grad logprobs [B, Tr] of a batch's responses (a spec reading answer_prob)."""
        return self.trainer.response_logprobs(batch)

    def update(self, estimated: TrainBatch, seed: int) -> dict[str, float]:
        m = self.trainer.update(estimated, torch.Generator().manual_seed(seed))
        self.trainer.step_schedule()
        return m

    @property
    def lr(self) -> float:
        return float(self.trainer.optimizer.param_groups[0]["lr"])

    def weights(self) -> EngineWeights:
        """The policy's weights as the run's sync kind sends them (views of the live parameters for
        the full state: ``snapshot()`` before keeping them across an update)."""
        weights = self.sync.send(self.policy)
        self.sync_bytes = weights.nbytes
        return weights

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
