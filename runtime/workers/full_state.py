"""The trainer ranks' full (unsharded) state on the driver, in the one-process checkpoint format:
:func:`trainer_state` rebuilds the modules on the meta device around a state the ranks gathered,
for ``save_checkpoint``; :func:`read_full_state` reads a checkpoint back for the ranks to load,
under the modules' own names (what the one-process resume loads: ``folder_state``).
So a run saved on N ranks resumes on any number of ranks, the one-process trainer included.
"""
from __future__ import annotations

from typing import Any

import torch

from ..config import RunConfig
from ..models.loading import policy_on_meta, with_tied
from ..recipe import with_lora
from ..records.checkpoint import Checkpoint, folder_state, saveable
from ..train.value_model import ValueModel
from .base import TrainerState


class _StateDict:
    """A saved state dict that quacks like the optimizer/scheduler it came from."""

    def __init__(self, state: dict[str, Any] | None):
        self._state = state

    def state_dict(self) -> dict[str, Any] | None:
        return self._state


def _on_meta(cfg: RunConfig, model_path: str) -> torch.nn.Module:
    """The policy's module tree on the meta device, with the run's LoRA layers if any: the
    names of the gathered state (``base_layer`` / ``lora_A`` / ``lora_B`` under LoRA)."""
    policy = policy_on_meta(model_path)
    with torch.device("meta"):
        return with_lora(cfg, policy)[0]


def _critic_on_meta(cfg: RunConfig, model_path: str) -> ValueModel:
    """The critic's module tree on the meta device (a value head over the policy's body)."""
    with torch.device("meta"):
        return ValueModel(_on_meta(cfg, model_path))


def trainer_state(cfg: RunConfig, model_path: str, state: dict[str, Any]) -> TrainerState:
    """What ``save_checkpoint`` needs, from the full states rank 0 gathered
    (``ShardedTrainer.full_state``): the policy and critic modules hold the gathered tensors."""
    policy = _on_meta(cfg, model_path)
    policy.load_state_dict(with_tied(saveable(state["policy"]), policy), assign=True)
    policy.tie_weights()
    critic = None
    if state["critic"] is not None:
        critic = _critic_on_meta(cfg, model_path)
        critic.load_state_dict(saveable(state["critic"]), assign=True)
    return TrainerState(policy, _StateDict(state["optimizer"]), _StateDict(state["scheduler"]),
                        critic, _StateDict(state["critic_optimizer"]), state["algorithm"],
                        loss_scale=state.get("loss_scale"))


def read_full_state(cfg: RunConfig, model_path: str, c: Checkpoint) -> dict[str, Any]:
    """A checkpoint's states as ``ShardedTrainer.load_full_state`` takes them (any number of ranks).
    The weights are read under the modules' own names, as the one-process resume reads them: a
    full-weight MoE's checkpoint holds its experts one tensor per expert (transformers' released
    layout), the ranks' modules hold them fused."""
    critic = None
    if c.critic_path is not None:
        critic = folder_state(_critic_on_meta(cfg, model_path), c.critic_path)
    return {"policy": folder_state(_on_meta(cfg, model_path), c.policy_path), "critic": critic,
            "optimizer": c.optimizer, "critic_optimizer": c.critic_optimizer,
            "scheduler": c.scheduler, "algorithm": c.extra.get("algorithm", {}),
            "loss_scale": c.extra.get("loss_scale")}
