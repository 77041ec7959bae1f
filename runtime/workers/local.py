"""The rollout and trainer sides in the calling process (no Ray): an engine and the reward,
a :class:`~rldsl.runtime.train.trainer.Trainer`. A Ray rollout actor wraps a ``LocalRollouts``."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch

from ..batch import RolloutBatch, repeat_each
from ..records.checkpoint import Checkpoint, load_weights
from ..rollout.engines.base import RolloutEngine, SamplingParams
from ..rollout.episodes.rollout import EpisodeRunner
from ..models.lora import merged_weights
from ..rollout.partial import generate_in_segments
from ..rewards.functions import RewardFn, RewardResult, unscored
from ..train.trainer import TrainBatch, Trainer
from .base import Generation, TrainerState


class LocalRollouts:
    """An engine and a reward function. Both are read at each call: replacing them takes effect."""

    def __init__(self, engine: RolloutEngine, reward: RewardFn, episodes: EpisodeRunner | Any = None):
        self.engine = engine
        self.reward = reward
        self.episodes = episodes  # multi-turn episodes (rollout.tools / env / agent), else None
        # partial rollouts (rollout.partial): (tokens per segment, refresh() -> version held)
        self.partial: tuple[int, Callable[[], int]] | None = None

    def sample_in_segments(self, tokens: int, refresh: Callable[[], int]) -> None:
        self.partial = (tokens, refresh)

    def generate(self, prompts: list[str | tuple], answers: list[str], params: SamplingParams,
                 reward_prompts: list[str] | None = None, score: bool = True) -> Generation:
        t0 = time.perf_counter()
        if self.episodes is not None:
            batch = self.episodes.run(self.engine, prompts, answers, params)
        elif self.partial is not None:  # segments, the newest published weights loaded between two
            tokens, refresh = self.partial
            batch = generate_in_segments(self.engine, prompts, params, tokens, refresh)
        else:
            batch = self.engine.generate(prompts, params)
        # rows per prompt: params.n, or more when an agent's episodes break into several rows
        batch.answers = repeat_each(answers, batch.group_size)
        t1 = time.perf_counter()
        if not score:
            return Generation(batch, unscored(len(batch.completions)), t1 - t0, 0.0)
        scored = self.reward.score(batch, None if reward_prompts is None
                                   else repeat_each(reward_prompts, batch.group_size))
        return Generation(batch, scored, t1 - t0, time.perf_counter() - t1)

    def score(self, batch: RolloutBatch, reward_prompts: list[str] | None = None) -> RewardResult:
        return self.reward.score(batch, reward_prompts)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.engine.update_weights(weights)
        loaded = getattr(self.episodes, "weights_loaded", None)
        if loaded is not None:  # an agent's endpoint records the policy version of each call
            loaded(version)

    def close(self) -> None:
        """Stop the engine's own processes, if it has any (vLLM's), and an agent's endpoint."""
        for owner in (self.episodes, self.engine):
            close = getattr(owner, "close", None)
            if callable(close):
                close()


class LocalTrainers:
    """One :class:`Trainer` (policy, reference, critic, optimizers) in this process."""

    world_size = 1

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    @property
    def policy(self) -> torch.nn.Module:
        return self.trainer.policy

    def estimate(self, rollout: RolloutBatch, rewards: torch.Tensor) -> TrainBatch:
        return self.trainer.estimate(rollout, rewards)

    def update(self, estimated: TrainBatch, seed: int) -> dict[str, float]:
        m = self.trainer.update(estimated, torch.Generator().manual_seed(seed))
        self.trainer.step_schedule()
        return m

    @property
    def lr(self) -> float:
        return float(self.trainer.optimizer.param_groups[0]["lr"])

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((k, v.detach()) for k, v in merged_weights(self.policy).items())  # LoRA merged

    def checkpoint_state(self) -> TrainerState:
        t = self.trainer
        return TrainerState(t.policy, t.optimizer, t.scheduler, t.critic, t.critic_optimizer,
                            t.fn.state_dict())

    def load_checkpoint(self, c: Checkpoint) -> None:
        t = self.trainer
        load_weights(t.policy, c.policy_path)
        if t.critic is not None and c.critic_path is not None:
            load_weights(t.critic, c.critic_path)
        t.fn.load_state_dict(c.extra.get("algorithm", {}))
        c.restore(optimizer=t.optimizer, scheduler=t.scheduler, critic_optimizer=t.critic_optimizer,
                  rng=False)

    def close(self) -> None:
        """Stop the teacher's own actor, if it has one (``teacher.actor``)."""
        close = getattr(self.trainer.teacher, "close", None)
        if callable(close):
            close()
