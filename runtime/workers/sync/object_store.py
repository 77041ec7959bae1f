"""The weight sync through Ray's object store (``distributed.weight_sync = "object_store"``, the
default): every trainer rank joins the gather, rank 0's weights (the run's kind: base.py ``kind_of``) stay in
the object store, and every rollout actor loads them from there within ``distributed.sync_timeout``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ray_cluster import RayCluster


@dataclass(frozen=True)
class Stored:
    """An ObjectRef to rank 0's :class:`~rldsl.runtime.workers.sync.base.EngineWeights`: immutable,
    so a snapshot itself."""

    ref: Any

    def snapshot(self) -> "Stored":
        return self


class ObjectStore:
    """The object store :class:`~rldsl.runtime.workers.sync.base.Transport`."""

    def __init__(self, cluster: RayCluster, sync_timeout: float):
        self.cluster, self.sync_timeout = cluster, sync_timeout
        self.bytes = 0

    def send(self, trainers: Any) -> Stored:
        """Every rank gathers (``TrainerWorker.full_weights``: (bytes, weights) on rank 0, (None,
        None) elsewhere); rank 0's weights stay in the object store."""
        calls = [(name, a.full_weights.options(num_returns=2).remote())
                 for name, a in zip(trainers.names, trainers.actors)]
        self.bytes = self.cluster.wait([(name, refs[0]) for name, refs in calls], self.sync_timeout,
                                       "the weight sync (gather)")[0]
        return Stored(calls[0][1][1])

    def receive(self, rollouts: Any, weights: Stored, version: int, policy_version: int) -> None:
        # the ObjectRef is a call's own argument: Ray hands each actor the weights themselves
        rollouts.run_all("the weight sync", self.sync_timeout,
                         lambda w: rollouts.actors[w].update_weights.remote(weights.ref, version, policy_version))

    def restore(self, rollouts: Any, w: int, weights: Stored, version: int, policy_version: int) -> None:
        self.cluster.wait([(rollouts.names[w], rollouts.actors[w].update_weights.remote(weights.ref, version,
                                                                                        policy_version))],
                          self.sync_timeout, "the weight sync after its restart")
