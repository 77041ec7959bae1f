"""What a run is made of: a :class:`Plan` (everything settled before a model loads: run/plan.py
makes it) and a :class:`Run` (its models loaded and its two sides started: run/build.py makes it).
Every module of a step reads the run through these two records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import rldsl
from rldsl.errors import SpecWarning

from ..batch import StepRollout
from ..config import RunConfig
from ..data.datasets import Example, PromptSource, rollout_prompts
from ..data.sources import Source
from ..rewards.functions import RewardFn
from ..rollout.producer import Produced, RolloutProducer
from ..workers.base import Rollouts, Trainers
from .eval_sets import EvalSet

#: The asynchronous producer of a run's step batches (rollout/producer.py; run/step_batch.py starts it)
StepProducer = RolloutProducer[StepRollout]


@dataclass
class Plan:
    """A run settled before any model loads; made by :func:`plan_run`, built by :func:`build`.

    ``cfg`` is resolved and frozen: what config.json records and what runs. ``source``: where
    its prompts come from (data/sources.py), asked once; ``prompts``: its training prompts.
    ``notes`` and ``warnings`` (the spec's run-start warnings) are printed when the run starts.
    """

    cfg: RunConfig
    algo: rldsl.Algorithm
    model_path: Path
    tokenizer: Any
    source: Source
    prompts: PromptSource
    heldout: list[Example]
    reward: RewardFn
    notes: list[str] = field(default_factory=list)
    warnings: list[SpecWarning] = field(default_factory=list)
    eval_sets: list[EvalSet] = field(default_factory=list)


@dataclass
class Run:
    """Everything one training run is made of; built by :func:`build` (or :func:`build_run`).

    The step talks to ``rollouts`` and ``trainers`` only (workers/base.py): in process
    (``LocalRollouts`` / ``LocalTrainers``) or on Ray actors (``RayRollouts`` / ``RayTrainers``).
    ``tokenizer`` (the driver's copy) is saved with every checkpoint. ``source``: the plan's (the
    task of a held-out row, ``Source.task_of``, is read there).
    """

    cfg: RunConfig
    algo: rldsl.Algorithm
    fn: rldsl.CompiledAlgorithm
    run_dir: Path
    tokenizer: Any
    prompts: PromptSource  # the training prompts: batches in order, per-task curriculum, retired ones
    heldout: list[Example]
    rollouts: Rollouts
    trainers: Trainers
    reward: RewardFn  # the run's reward (the rollout workers score with their own copies of it)
    source: Source  # where its prompts come from (data/sources.py): bound by the plan, asked once
    warn: Callable[[str], None] = print
    notes: list[str] = field(default_factory=list)
    warnings: list[SpecWarning] = field(default_factory=list)
    eval_sets: list[EvalSet] = field(default_factory=list)
    queued: list[Produced[StepRollout]] = field(default_factory=list)  # restored batches of an asynchronous run
    # the per-prompt reward statistics across steps (records/prompt_stats.py's PromptStats), kept
    # only when the spec reads them (prompt_mean, prompt_var, prompt_count); saved in checkpoints
    prompt_stats: Any = None
    # sampling replay: the run's rollout/replay.ReplayBuffer (made by build, saved with checkpoints); None: none
    replay: Any = None
    # the reference model's rollouts (reward.reference: an engine and the run's reward) when the spec reads
    # ref_reward (workers/start.py reference_rollouts); None: none
    reference: Rollouts | None = None

    @property
    def multi_turn(self) -> bool:
        """Whether samples are multi-turn episodes (rollout.tools / rollout.env / rollout.agent)."""
        r = self.cfg.rollout
        return r.tools is not None or r.env is not None or r.agent is not None

    def rollout_prompts(self, examples: Sequence[Example]) -> list[str | tuple]:
        """What the rollouts start from (``data.rollout_prompts``)."""
        return rollout_prompts(examples, self.multi_turn)

    def close(self) -> None:
        """Stop the actors of a distributed run (nothing to do for a one-process run)."""
        self.rollouts.close()
        self.trainers.close()
        if self.reference is not None:
            self.reference.close()
