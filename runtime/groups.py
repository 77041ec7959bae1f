"""The two groups a training step talks to, and their one-process implementations.

The run loop (loop.py) never touches an engine, a reward function or a trainer directly:
it asks a **rollout group** for scored samples and a **trainer group** for old logprobs,
advantages, updates, weights and checkpoint state. Two implementations exist:

- here, ``LocalRolloutGroup`` / ``LocalTrainerGroup``: the engine, the reward and the
  :class:`~rldsl.runtime.trainer.Trainer` of a :class:`~rldsl.runtime.loop.Setup`, in the
  driver process (no Ray);
- in distributed.py, ``RayRolloutGroup`` / ``RayTrainerGroup``: M rollout actors (engine +
  reward each) and N FSDP2 trainer ranks on Ray.

So the step itself (rollout -> reward -> score -> update -> sync -> metrics/checkpoint) is
written once, in loop.py, for both.

Interface (duck-typed; both implementations follow it)::

    rollouts.generate(prompts, answers, params) -> Generation     # G samples per prompt, scored
    rollouts.load_weights(weights)                                 # weights from trainers.weights()
    rollouts.close()

    trainers.score(rollout, rewards) -> Scored                     # .metrics; kept for update()
    trainers.update(scored, seed) -> dict[str, float]              # minibatch updates + LR schedule
    trainers.lr -> float
    trainers.weights() -> opaque handle for rollouts.load_weights
    trainers.checkpoint_state() -> TrainerState                    # what save_checkpoint needs
    trainers.load_checkpoint(ckpt: Checkpoint) -> None             # weights, optimizers, scheduler, algorithm state
    trainers.close()
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from .rewards import RewardResult
from .types import RolloutBatch, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint import Checkpoint
    from .loop import Setup


class WorkerError(RuntimeError):
    """A Ray actor died, failed or timed out; the message names it ("rollout worker 1 died: ...")."""


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
    compiled algorithm's own state (e.g. an EMA baseline).
    """

    policy: Any
    optimizer: Any
    scheduler: Any
    critic: Any = None
    critic_optimizer: Any = None
    algorithm: dict[str, torch.Tensor] = field(default_factory=dict)


class StateDictHolder:
    """A saved state dict that quacks like the optimizer/scheduler it came from."""

    def __init__(self, state: dict[str, Any] | None):
        self._state = state

    def state_dict(self) -> dict[str, Any] | None:
        return self._state


def merge_rewards(results: Sequence[RewardResult]) -> RewardResult:
    """Rewards of consecutive chunks of one batch, as if scored at once."""
    if len(results) == 1:
        return results[0]
    keys = list(results[0].components)
    first = next((r.first_error for r in results if r.first_error is not None), None)
    return RewardResult(torch.cat([r.rewards for r in results]),
                        {k: torch.cat([r.components[k] for r in results]) for k in keys},
                        sum(r.num_errors for r in results), first)


# ----------------------------------------------------------------------------- local

class LocalRolloutGroup:
    """The Setup's engine and reward function, in this process.

    Reads ``setup.engine`` and ``setup.reward`` at each call, so replacing them on the
    Setup (tests do) takes effect.
    """

    def __init__(self, setup: "Setup"):
        self._s = setup

    def generate(self, prompts: list[str], answers: list[str], params: SamplingParams) -> Generation:
        t0 = time.perf_counter()
        batch = self._s.engine.generate(prompts, params)
        batch.answers = [a for a in answers for _ in range(params.n)]
        t1 = time.perf_counter()
        scored = self._s.reward.score(batch)
        return Generation(batch, scored, t1 - t0, time.perf_counter() - t1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._s.engine.update_weights(weights)

    def close(self) -> None:
        pass


class LocalTrainerGroup:
    """The Setup's :class:`Trainer` (policy, reference, critic, optimizers), in this process."""

    world_size = 1

    def __init__(self, setup: "Setup"):
        self._s = setup

    def score(self, rollout: RolloutBatch, rewards: torch.Tensor):
        return self._s.trainer.score(rollout, rewards)

    def update(self, scored: Any, seed: int) -> dict[str, float]:
        trainer = self._s.trainer
        m = trainer.update(scored, torch.Generator().manual_seed(seed))
        trainer.step_schedule()
        return m

    @property
    def lr(self) -> float:
        return float(self._s.trainer.optimizer.param_groups[0]["lr"])

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((k, v.detach()) for k, v in self._s.policy.state_dict().items())

    def checkpoint_state(self) -> TrainerState:
        t = self._s.trainer
        return TrainerState(self._s.policy, t.optimizer, t.scheduler, t.critic, t.critic_optimizer,
                            self._s.fn.state_dict())

    def load_checkpoint(self, c: "Checkpoint") -> None:
        from . import checkpoint as ckpt
        t = self._s.trainer
        ckpt.load_weights(self._s.policy, c.policy_path)
        if t.critic is not None and c.critic_path is not None:
            ckpt.load_weights(t.critic, c.critic_path)
        self._s.fn.load_state_dict(c.extra.get("algorithm", {}))
        c.restore(optimizer=t.optimizer, scheduler=t.scheduler, critic_optimizer=t.critic_optimizer,
                  rng=False)

    def close(self) -> None:
        pass
