"""The trainer side on Ray, driven from the driver: ``RayTrainers`` calls N ``TrainerWorker``
actors (trainer_actor.py), one rank each, and awaits them (ray_cluster.py). The batch goes to
every rank through Ray's object store; the weight sync gathers the full state dict on every
rank, rank 0's copy staying in the object store for the rollout actors; checkpoints are
written by the driver from the gathered full states (full_state.py), in the one-process format.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

from ..batch import RolloutBatch
from ..config import RunConfig
from ..records.checkpoint import Checkpoint
from .base import TrainerState
from .full_state import read_full_state, trainer_state
from .ray_cluster import RayCluster
from .sync.base import Transport, Weights


@dataclasses.dataclass
class _Estimated:
    """What the driver keeps of an estimated batch (the batch itself stays on the ranks)."""

    metrics: dict[str, float]


class RayTrainers:
    """N ``TrainerWorker`` actors (trainer_actor.py) behind the ``Trainers`` interface (base.py)."""

    def __init__(self, cluster: RayCluster, cfg: RunConfig, actors: list[Any], model_path: str, sync: Transport):
        """``actors``: the N ``TrainerWorker`` actors, rank r at index r (ray.py spawns them);
        ``sync``: the weight sync's transport (the rollouts' too)."""
        self.cluster, self.cfg, self.model_path = cluster, cfg, model_path
        self.actors = actors
        self.world_size = len(actors)
        self.names = [f"trainer rank {r}" for r in range(len(actors))]
        self._lr = cfg.train.lr
        self.sync = sync

    def start(self) -> list[tuple[str, Any]]:
        """Rendezvous and begin loading (returns the calls to wait for)."""
        c, timeout = self.cluster, self.cfg.distributed.call_timeout
        nodes = c.wait(self._calls("node"), timeout, "start-up")
        host, port = c.wait([(self.names[0], self.actors[0].rendezvous.remote(len(set(nodes)) == 1))], timeout,
                            "start-up")[0]
        return [(name, a.setup.remote(host, port)) for name, a in zip(self.names, self.actors)]

    def _calls(self, method: str, *args: Any) -> list[tuple[str, Any]]:
        return [(name, getattr(a, method).remote(*args)) for name, a in zip(self.names, self.actors)]

    def _all(self, method: str, *args: Any, what: str) -> list[Any]:
        return self.cluster.wait(self._calls(method, *args), self.cfg.distributed.call_timeout, what)

    def estimate(self, rollout: RolloutBatch, rewards: Tensor) -> _Estimated:
        data = self.cluster.ray.put((rollout, rewards))
        return _Estimated(self._all("estimate", data, what="old/reference logprobs")[0])

    def advantages(self) -> Tensor:
        """The last estimated batch's advantages [B, Tr], from rank 0 (the batch stays on the
        ranks; ``replay(advantage=keep)`` asks for them, rollout/replay.py)."""
        c = self.cluster
        return c.wait([(self.names[0], self.actors[0].advantages.remote())], self.cfg.distributed.call_timeout,
                      "the advantages")[0]

    def update(self, estimated: _Estimated, seed: int) -> dict[str, float]:
        out = self._all("update", seed, what="the update")[0]
        self._lr = out["lr"]
        return out["metrics"]

    @property
    def lr(self) -> float:
        return self._lr

    def weights(self) -> Weights:
        """The current weights as the run's transport sends them: rank 0's gathered weights in the
        object store (within ``sync_timeout``), or with ``distributed.weight_sync = "collective"``
        a handle (nothing moves until the rollouts receive)."""
        return self.sync.send(self)

    @property
    def sync_bytes(self) -> int:
        """The bytes the last weight sync sent to each rollout worker (``sync/bytes``)."""
        return self.sync.bytes

    def checkpoint_state(self) -> TrainerState:
        return trainer_state(self.cfg, self.model_path, self._all("checkpoint_state", what="the checkpoint gather")[0])

    def load_checkpoint(self, c: Checkpoint) -> None:
        state = read_full_state(self.cfg, self.model_path, c)
        self._all("load_state", self.cluster.ray.put(state), what=f"loading {c.path.name}")

    def close(self) -> None:
        self.cluster.close()
