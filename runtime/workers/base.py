"""What a training step talks to: the rollout side and the trainer side, however many
workers stand behind each.

The loop (loop.py) never touches an engine, a reward function or a trainer directly: it
asks ``rollouts`` for scored samples and ``trainers`` for old logprobs and advantages,
updates, weights and checkpoint state. Implementations: in the driver process
(local.py, local_trainers.py) and on Ray actors (ray_rollouts.py, ray_trainers.py); the step
is written once for both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

from ..batch import RolloutBatch
from ..records.checkpoint import Checkpoint
from ..rollout.engines.base import SamplingParams
from ..rewards.functions import RewardResult
if TYPE_CHECKING:  # annotations only: sync/ imports torch, which `rldsl run` loads after its checks
    from .sync.base import Weights


@dataclass
class Generation:
    """Scored samples of P prompts x G (groups contiguous) and where the time went."""

    batch: RolloutBatch
    scored: RewardResult
    generate_s: float
    reward_s: float


@dataclass
class TrainerState:
    """What ``checkpoint.save_checkpoint`` needs from the trainers.

    ``policy`` / ``critic``: modules to save (``save_pretrained``); ``optimizer``,
    ``scheduler``, ``critic_optimizer``: objects with ``state_dict()``; ``algorithm``: the
    compiled algorithm's own state (e.g. an EMA baseline); ``teacher``: the EMA teacher's
    weights (``teacher.ema``), None without one; ``loss_scale``: float16's dynamic loss scaler
    (train/loss_scale.py), None without one.
    """

    policy: Any
    optimizer: Any
    scheduler: Any
    critic: Any = None
    critic_optimizer: Any = None
    algorithm: dict[str, torch.Tensor] = field(default_factory=dict)
    teacher: dict[str, torch.Tensor] | None = None
    loss_scale: dict[str, float] | None = None


class EpisodeRunner(Protocol):
    """What runs a run's multi-turn episodes (rollout/multi_turn.py ``episode_runner``: the
    tools' and environments' ``EpisodeRunner``, an agent's ``AgentRunner``)."""

    def run(self, engine: Any, prompts: list[str | tuple], answers: list[str],
            params: SamplingParams) -> RolloutBatch:
        """``params.n`` episodes per prompt (the rows' own prompts), one batch."""
        ...


class Rollouts(Protocol):
    """Samples and scores prompts; loads the trainers' weights."""

    def generate(self, prompts: list[str | tuple], answers: list[str], params: SamplingParams,
                 reward_prompts: list[str] | None = None, score: bool = True) -> Generation:
        """``params.n`` samples per prompt (the engine tokenizes ``prompts``: the templated
        text; with multi-turn episodes, the rows' own prompts: ``data.rollout_prompts``),
        scored by the reward against ``answers``; the reward functions receive
        ``reward_prompts`` (the rows' original prompts; default ``prompts``). ``score=False``:
        samples only (an evaluation set with its own reward scores them itself); the
        rewards are then NaN."""
        ...

    def score(self, batch: RolloutBatch, reward_prompts: list[str] | None = None) -> RewardResult:
        """Score samples made with ``generate(score=False)`` with the reward, where the reward
        lives (this process, or the rollout actors); ``reward_prompts``: one per row."""
        ...

    def load_weights(self, weights: Weights, version: int) -> None:
        """Load what ``Trainers.weights()`` returned into every engine: policy ``version`` (the
        weights after that many optimizer steps; what an agent's calls record). Its kind is the
        run's, chosen at start-up (sync/base.py ``kind_of``): nothing here asks the value what it is."""
        ...

    def sample_in_segments(self, tokens: int, refresh: Callable[[], int]) -> None:
        """Partial rollouts (``rollout.partial``): from now on sample ``tokens`` at a time and call
        ``refresh()`` (it loads the newest published weights, returns the version held) between
        two segments. One process only (checked before the run starts)."""
        ...

    def close(self) -> None:
        ...


class Trainers(Protocol):
    """The policy (and reference, critic) and its optimizers, on one or N ranks."""

    world_size: int

    def estimate(self, rollout: RolloutBatch, rewards: torch.Tensor) -> Any:
        """Old/reference logprobs and advantages; the result has ``.metrics`` and goes to ``update``."""
        ...

    def update(self, estimated: Any, seed: int) -> dict[str, float]:
        """Minibatch updates on the estimated batch, then one LR-schedule step; the metrics."""
        ...

    @property
    def lr(self) -> float:
        ...

    def weights(self) -> Weights:
        """The current policy weights for ``Rollouts.load_weights``, as the run's sync sends them
        (``snapshot()`` before holding them across an update)."""
        ...

    def checkpoint_state(self) -> TrainerState:
        ...

    def load_checkpoint(self, c: Checkpoint) -> None:
        """Weights, critic, algorithm state, optimizers, scheduler (not the RNGs)."""
        ...

    def close(self) -> None:
        ...
