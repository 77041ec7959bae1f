"""The rollout side in the calling process (no Ray): an engine, the reward and the multi-turn
episodes, if any, built by the run's recipe (:meth:`LocalRollouts.from_config`: ``rldsl run``,
a Ray rollout actor -- rollout_actor.py wraps a ``LocalRollouts`` --, ``rldsl eval``); the
trainer side in this process is local_trainers.py."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from ..batch import RolloutBatch, repeat_each
from ..config import RunConfig
from ..recipe import rollout_side
from ..rollout.engines.base import RolloutEngine, SamplingParams
from ..rollout.sampling import sample_rows
from ..rewards.functions import RewardFn, RewardResult, unscored
from .base import EpisodeRunner, Generation
from .sync.base import EngineWeights


class LocalRollouts:
    """An engine and a reward function. Both are read at each call: replacing them takes effect."""

    def __init__(self, engine: RolloutEngine, reward: RewardFn, runner: EpisodeRunner | None = None):
        self.engine = engine
        self.reward = reward
        self.runner = runner  # multi-turn episodes (rollout.tools / env / agent), else None
        # partial rollouts (rollout.partial): (tokens per segment, refresh() -> version held)
        self.partial: tuple[int, Callable[[], int]] | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig, model_path: Path | str, device: str, *, reward: RewardFn | None = None,
                    model: Any = None, tokenizer: Any = None, gpus: float = 0.0) -> "LocalRollouts":
        """The rollout side of a resolved config, its parts built by the recipe (recipe.py
        ``rollout_side``: the engine, the reward -- ``reward``, else the config's --, the episodes)."""
        return cls(*rollout_side(cfg, model_path, device, reward=reward, model=model, tokenizer=tokenizer,
                                 gpus=gpus))

    def sample_in_segments(self, tokens: int, refresh: Callable[[], int]) -> None:
        self.partial = (tokens, refresh)

    def generate(self, prompts: list[str | tuple], answers: list[str], params: SamplingParams,
                 reward_prompts: list[str] | None = None, score: bool = True) -> Generation:
        t0 = time.perf_counter()
        if self.runner is not None:
            batch = self.runner.run(self.engine, prompts, answers, params)
        else:  # a tree per prompt (sampling tree), segments (rollout.partial), or plain samples
            batch = sample_rows(self.engine, prompts, params, self.partial)
        # rows per prompt: params.n, or more when an agent's episodes break into several rows
        batch.answers = repeat_each(answers, batch.group_size)
        # the rows' images as the policy's kind reads them, processed once for every forward of the trainer
        batch.image_inputs = self.engine.kind.processed(batch.images)
        t1 = time.perf_counter()
        if not score:
            return Generation(batch, unscored(len(batch.completions)), t1 - t0, 0.0)
        scored = self.reward.score(batch, None if reward_prompts is None
                                   else repeat_each(reward_prompts, batch.group_size))
        return Generation(batch, scored, t1 - t0, time.perf_counter() - t1)

    def score(self, batch: RolloutBatch, reward_prompts: list[str] | None = None) -> RewardResult:
        return self.reward.score(batch, reward_prompts)

    def load_weights(self, weights: EngineWeights, version: int) -> None:
        """The trainers' weights into the engine, as their kind loads them (sync/: the full state
        in place, or the LoRA adapters alone as the engine's adapter of policy ``version``)."""
        weights.load_into(self.engine, version)
        loaded = getattr(self.runner, "weights_loaded", None)
        if loaded is not None:  # an agent's endpoint records the policy version of each call
            loaded(version)

    def close(self) -> None:
        """Stop the engine's own processes, if it has any (vLLM's), and an agent's endpoint."""
        for owner in (self.runner, self.engine):
            close = getattr(owner, "close", None)
            if callable(close):
                close()
