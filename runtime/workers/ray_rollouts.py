"""The rollout side on Ray, driven from the driver: ``RayRollouts`` splits the P prompts of a
round into M contiguous chunks that M ``RolloutWorker`` actors (rollout_actor.py) sample *and
score*. With M > 1, chunk w samples with ``SamplingParams.for_chunk(w)``:
reproducible for a given M, not the samples of M = 1. Weight sync: every actor loads the
trainers' weights as the run's transport carries them (sync/: from Ray's object store, within
``distributed.sync_timeout``, or, with ``distributed.weight_sync = "collective"``, the buckets
trainer rank 0 broadcasts).

Faults: a rollout actor that dies is restarted (``distributed.max_restarts`` times each; Ray
runs its ``__init__`` again): it is given the weights it last held and the call is made again
(the same seeds: the same samples).
"""
from __future__ import annotations

import sys
import time
from typing import Any, Sequence

import torch

from ..batch import RolloutBatch
from ..config import RunConfig
from ..errors import ConfigError, WorkerError
from ..rewards.functions import RewardResult
from ..rollout.engines.base import SamplingParams
from .base import Generation
from .ray_cluster import RayCluster
from .sync.base import Transport, Weights


def _merge_rewards(results: Sequence[RewardResult]) -> RewardResult:
    """Rewards of consecutive chunks of one batch, as if scored at once."""
    if len(results) == 1:
        return results[0]
    keys = list(results[0].components)
    first = next((r.first_error for r in results if r.first_error is not None), None)
    return RewardResult(torch.cat([r.rewards for r in results]),
                        {k: torch.cat([r.components[k] for r in results]) for k in keys},
                        sum(r.num_errors for r in results), first,
                        num_timeouts=sum(r.num_timeouts for r in results))


class RayRollouts:
    """M ``RolloutWorker`` actors (rollout_actor.py) behind the ``Rollouts`` interface (base.py)."""

    def __init__(self, cluster: RayCluster, cfg: RunConfig, actors: list[Any], pad_id: int, sync: Transport):
        """``actors``: the M ``RolloutWorker`` actors, worker w at index w (ray.py spawns them, each
        restartable ``distributed.max_restarts`` times); ``sync``: the weight sync's transport (the
        trainers' too)."""
        self.cluster, self.cfg, self.pad_id, self.sync = cluster, cfg, pad_id, sync
        self.max_restarts = cfg.distributed.max_restarts
        self.actors = actors
        self.names = [f"rollout worker {w}" for w in range(len(actors))]
        self.restarts = [0] * len(actors)  # per actor, counted against distributed.max_restarts
        self.version = 0  # the driver's sync count
        self.weights: Weights | None = None  # the weights every actor should hold
        self.policy_version = 0  # ... and their policy version (optimizer steps)

    def run_all(self, what: str, timeout: float | None, call: Any) -> list[Any]:
        """``call(w)`` (an ObjectRef) on every actor w, awaited; a dead actor (or one restarted
        since its last sync, whose call answers None) is given its weights again and every
        call is made again, up to ``max_restarts`` times per actor."""
        while True:
            try:
                results = self.cluster.wait([(name, call(w)) for w, name in enumerate(self.names)], timeout, what)
            except WorkerError as e:
                dead = getattr(e, "died", None)
                if dead is None:
                    raise
                self._restarted(self.names.index(dead), str(e))
                continue
            stale = [w for w, r in enumerate(results) if r is None]
            if not stale:
                return results
            for w in stale:
                self._restarted(w, f"{self.names[w]} was restarted by Ray during {what}")

    def _restarted(self, w: int, why: str) -> None:
        """Count actor w's restart (a WorkerError once ``max_restarts`` are spent), wait for it
        to be up, and give it the weights it should hold."""
        self.restarts[w] += 1
        if self.restarts[w] > self.max_restarts:
            raise WorkerError(f"{why}\n{self.names[w]} died {self.restarts[w]} times: "
                              f"distributed.max_restarts={self.max_restarts} restarts are spent")
        print(f"{why}; restarting it ({self.restarts[w]} of distributed.max_restarts={self.max_restarts})",
              file=sys.stderr)
        actor, name, d = self.actors[w], self.names[w], self.cfg.distributed
        deadline = time.monotonic() + d.sync_timeout
        try:
            while True:  # Ray answers "unavailable" until the new process has run __init__
                try:
                    self.cluster.wait([(name, actor.ready.remote())], d.sync_timeout, "its restart")
                    break
                except WorkerError as e:
                    if not getattr(e, "restarting", False) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            if self.weights is not None:
                self.sync.restore(self, w, self.weights, self.version, self.policy_version)
        except WorkerError as e:
            if getattr(e, "died", None) is None:
                raise
            self._restarted(w, str(e))  # died again while restarting: counted too

    def start(self) -> list[tuple[str, Any]]:
        return [(name, a.ready.remote()) for name, a in zip(self.names, self.actors)]

    def generate(self, prompts: list[str | tuple], answers: list[str], params: SamplingParams,
                 reward_prompts: list[str] | None = None, score: bool = True) -> Generation:
        bounds = torch.arange(len(prompts)).tensor_split(len(self.actors))
        chunks = {w: (int(b[0]), int(b[-1]) + 1) for w, b in enumerate(bounds) if len(b)}

        def call(w: int) -> Any:
            if w not in chunks:
                return self.actors[w].ready.remote()  # nothing to sample: a liveness probe
            lo, hi = chunks[w]
            p = params.for_chunk(w) if len(chunks) > 1 else params
            rp = None if reward_prompts is None else reward_prompts[lo:hi]
            return self.actors[w].generate.remote(self.version, prompts[lo:hi], answers[lo:hi], p, rp, score)

        t0 = time.perf_counter()
        gens: list[Generation] = [g for w, g in enumerate(self.run_all("the rollout", self.cfg.distributed.call_timeout,
                                                                    call)) if w in chunks]
        wall = time.perf_counter() - t0
        reward_s = max(g.reward_s for g in gens)
        return Generation(RolloutBatch.concat([g.batch for g in gens], self.pad_id),
                          _merge_rewards([g.scored for g in gens]), wall - reward_s, reward_s)

    def score(self, batch: RolloutBatch, reward_prompts: list[str] | None = None) -> RewardResult:
        """The rows split across the actors' rewards (consecutive chunks), scored at once."""
        bounds = torch.arange(len(batch)).tensor_split(len(self.actors))

        def call(w: int) -> Any:
            rows = bounds[w]
            if not len(rows):
                return self.actors[w].ready.remote()
            return self.actors[w].score.remote(
                batch.select(rows), None if reward_prompts is None else [reward_prompts[i] for i in rows.tolist()])

        results = self.run_all("the scoring", self.cfg.distributed.call_timeout, call)
        return _merge_rewards([r for w, r in enumerate(results) if len(bounds[w])])

    def load_weights(self, weights: Weights, version: int) -> None:
        """Every actor loads what ``RayTrainers.weights()`` returned, policy ``version``, as the
        run's transport carries it (``sync_timeout`` per actor)."""
        self.version, self.weights, self.policy_version = self.version + 1, weights, version
        self.sync.receive(self, weights, self.version, version)

    def sample_in_segments(self, tokens: int, refresh: Any) -> None:
        """Partial rollouts run in one process (the run is refused before it starts)."""
        raise ConfigError("rollout.partial runs in one process: not with Ray rollout workers")

    def close(self) -> None:
        self.cluster.close()
