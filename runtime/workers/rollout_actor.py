"""A rollout worker on a Ray actor: ``RolloutWorker`` holds an engine (``hf`` or ``vllm``, CPU
or GPU) and the reward -- a :class:`~rldsl.runtime.workers.local.LocalRollouts` built from the
run's config in the actor's process -- and samples and scores the chunk of prompts it is
given; ``RayRollouts`` (ray_rollouts.py) drives M of them. Every call names the weights
version it expects, so an actor Ray restarted unnoticed is never sampled with its starting
weights.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..batch import RolloutBatch
from ..errors import ConfigError
from ..rewards.functions import RewardResult
from ..rollout.engines.base import SamplingParams
from .base import Generation
from .local import LocalRollouts
from .ray_cluster import actor_config
from .sync.base import EngineWeights


class RolloutWorker:
    """One rollout actor: an engine and the reward; samples and scores its chunk of prompts."""

    def __init__(self, index: int, payload: dict[str, Any]):
        cfg = actor_config(payload)
        self.index = index
        gpus = payload["rollout_gpus"]
        self.local = LocalRollouts.from_config(cfg, cfg.model.path, "cuda" if gpus > 0 else "cpu", gpus=gpus)
        self.version = 0  # the weights held: 0 = the model folder's, n = the driver's n-th sync

    def ready(self) -> int:
        return self.index

    def generate(self, version: int, prompts: list[str | tuple], answers: list[str], params: SamplingParams,
                 reward_prompts: list[str] | None = None, score: bool = True) -> Generation | None:
        """The chunk's samples; None when this actor does not hold weights ``version`` (Ray
        restarted it since its last sync)."""
        if version != self.version:
            return None
        return self.local.generate(prompts, answers, params, reward_prompts, score)

    def score(self, batch: RolloutBatch, reward_prompts: list[str] | None = None) -> RewardResult:
        return self.local.score(batch, reward_prompts)

    def update_weights(self, weights: EngineWeights, version: int, policy_version: int) -> int:
        """``weights``: trainer rank 0's, from the object store (sync/object_store.py); ``version``:
        the driver's sync count (a restarted actor holds 0); ``policy_version``: the optimizer steps
        the weights have had."""
        self.local.load_weights(weights, policy_version)
        self.version = version
        return version

    def engine_weights(self) -> dict[str, Tensor]:
        """The engine's current weights on CPU, HF-named: a probe of what the weight sync
        delivered (the hf engine's state dict; vLLM's ``read_weights``, read through its kernels)."""
        engine = self.local.engine
        if callable(getattr(engine, "read_weights", None)):
            return engine.read_weights()
        model = getattr(engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"engine_weights() cannot read a {type(engine).__name__}")
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
