"""The collective weight sync on Ray (``distributed.weight_sync = "collective"``), driven from the
driver: :class:`CollectiveSync` is its :class:`~rldsl.runtime.workers.sync.base.Transport`. Its
``send`` moves nothing (the trainers' side answers with the transport itself); its ``receive`` forms
the sync's process group (trainer rank 0 and every rollout worker, buckets.py) the first time and
after a rollout worker was restarted, then runs one sync: every trainer rank gathers the buckets,
rank 0 broadcasts them, every rollout worker (this module's :class:`RolloutWorker`, a
rollout_actor.py one that joins the group) loads them into its engine in place as they arrive.

Fails loudly: every broadcast waits at most ``distributed.sync_timeout`` and raises naming its side
and bucket; the driver waits for the whole sync at most twice that (so the waiting side reports
first, naming the bucket). A rollout worker that dies mid-sync is restarted (``max_restarts``),
the group formed again and the sync made again; once the restarts are spent the run stops with
the resume command.
"""
from __future__ import annotations

from typing import Any

import torch

from ... import faults
from ...config import RunConfig
from ...errors import WorkerError
from ..ray_cluster import RayCluster, actor_config
from .. import rollout_actor
from .base import kind_of
from .buckets import SyncGroup, from_plain, receive_buckets


class RolloutWorker(rollout_actor.RolloutWorker):
    """A rollout worker that also joins the weight-sync group and loads broadcast buckets. (Named
    as the plain one: Ray's process title and actor listings read ``ray::RolloutWorker`` on
    either path.)"""

    def __init__(self, index: int, payload: dict[str, Any]):
        super().__init__(index, payload)
        self.sync_group: SyncGroup | None = None
        self.sync_timeout = float(payload["sync_timeout"])
        self.device = torch.device("cuda" if payload["rollout_gpus"] > 0 else "cpu")
        self.kind = kind_of(actor_config(payload))  # model.lora.sync = "adapter": the buckets hold the adapters alone

    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def sync_join(self, host: str, port: int, world: int, generation: int, plan: list) -> int:
        """Join weight-sync group ``generation`` as rank ``index + 1`` (the previous one is dropped)."""
        if self.sync_group is not None:
            self.sync_group.close()
        self.plan = from_plain(plan)
        self.sync_group = SyncGroup(host, port, self.index + 1, world, self.sync_timeout, self.device,
                                    generation, f"rollout worker {self.index}")
        return generation

    def sync_receive(self, generation: int, version: int, policy_version: int) -> int | None:
        """Load the broadcast buckets into the engine in place; None when this actor is not in
        group ``generation`` (Ray restarted it: the driver forms the group again)."""
        group = self.sync_group
        if group is None or group.generation != generation:
            return None
        def buckets() -> Any:
            for i, (name, tensor) in enumerate(receive_buckets(group, self.plan)):
                if i == len(self.plan[0]):  # the first bucket handed to the engine
                    faults.at("sync_bucket", policy_version)
                yield name, tensor

        nbytes = sum(e.nbytes for bucket in self.plan for e in bucket)
        self.local.load_weights(self.kind.received(buckets(), nbytes), policy_version)
        self.version = version
        return version


class CollectiveSync:
    """The collective transport: ``RayTrainers.weights()`` answers with it (a handle: nothing moves);
    the sync runs when ``RayRollouts.load_weights`` hands it back to :meth:`receive` (both sides take
    part at once). ``trainers``: the trainer ranks' actors; ``local``: every actor on one node (the
    group's store then listens on 127.0.0.1), None: asked of the actors when the group first forms."""

    def __init__(self, cluster: RayCluster, cfg: RunConfig, trainers: list[Any], local: bool | None = None):
        self.cluster, self.cfg, self.trainers, self.local = cluster, cfg, trainers, local
        self.trainer_names = [f"trainer rank {r}" for r in range(len(trainers))]
        self.generation = 0  # the group's incarnation (formed again after a rollout worker restart)
        self.formed = False
        self.plain_plan: list | None = None
        self.bytes = 0  # the bytes of the last sync (sync/bytes)

    def send(self, trainers: Any) -> "CollectiveSync":
        return self

    def snapshot(self) -> "CollectiveSync":
        """Itself: the sync sends the weights the trainers hold when it runs (an asynchronous run,
        which publishes older versions, is refused this transport before it starts)."""
        return self

    def receive(self, rollouts: Any, weights: Any, version: int, policy_version: int) -> None:
        self.push(rollouts, version, policy_version)

    def restore(self, rollouts: Any, w: int, weights: Any, version: int, policy_version: int) -> None:
        """A restarted process is in no group: the group is formed again and every worker synced."""
        self.push(rollouts, version, policy_version, reform=True)

    def _on_one_node(self, rollouts: Any) -> bool:
        if self.local is None:
            c, d = self.cluster, self.cfg.distributed
            nodes = c.wait([(n, t.node.remote()) for n, t in zip(self.trainer_names, self.trainers)]
                           + [(n, a.node.remote()) for n, a in zip(rollouts.names, rollouts.actors)],
                           d.call_timeout, "the weight sync (group)")
            self.local = len(set(nodes)) == 1
        return self.local

    def _form(self, rollouts: Any) -> None:
        d, c = self.cfg.distributed, self.cluster
        if self.plain_plan is None:
            max_bytes = int(d.sync_bucket_mb * 2**20)
            plans = c.wait([(n, t.sync_plan.remote(max_bytes)) for n, t in zip(self.trainer_names, self.trainers)],
                           d.sync_timeout, "the weight sync (bucket plan)")
            self.plain_plan = plans[0]
        self.generation += 1
        host, port = c.wait([(self.trainer_names[0], self.trainers[0].sync_listen.remote(self._on_one_node(rollouts)))],
                            d.sync_timeout, "the weight sync (group)")[0]
        world = 1 + len(rollouts.actors)
        calls = [(self.trainer_names[0], self.trainers[0].sync_join.remote(host, port, world, self.generation))]
        calls += [(name, a.sync_join.remote(host, port, world, self.generation, self.plain_plan))
                  for name, a in zip(rollouts.names, rollouts.actors)]
        c.wait(calls, 2 * d.sync_timeout, "forming the weight-sync group")
        self.formed = True

    def _dead_worker(self, rollouts: Any) -> str | None:
        """After a failed sync: the first rollout worker that died in it (the broadcast to it failed
        first, or its death was reported second), or None when every one answers."""
        for name, actor in zip(rollouts.names, rollouts.actors):
            try:
                self.cluster.wait([(name, actor.ready.remote())], self.cfg.distributed.sync_timeout,
                                  "a liveness check after a failed weight sync")
            except WorkerError as e:
                if getattr(e, "died", None) is not None:
                    return e.died
        return None

    def push(self, rollouts: Any, version: int, policy_version: int, reform: bool = False) -> None:
        """One sync to every rollout worker of ``rollouts`` (a RayRollouts): its weights ``version``
        (the driver's sync count) and ``policy_version``. A rollout worker that dies or was
        restarted is restarted by ``rollouts`` (counted against max_restarts), which restores it
        (:meth:`restore`): the group is formed again first (the restarted process is not in it)."""
        d, c = self.cfg.distributed, self.cluster
        if reform:
            self.formed = False
        try:
            if not self.formed:
                self._form(rollouts)
            calls = [(n, t.sync_send.remote(self.generation)) for n, t in zip(self.trainer_names, self.trainers)]
            calls += [(name, a.sync_receive.remote(self.generation, version, policy_version))
                      for name, a in zip(rollouts.names, rollouts.actors)]
            results = c.wait(calls, 2 * d.sync_timeout, "the weight sync (collective)")
        except WorkerError as e:
            died = getattr(e, "died", None)
            dead = died or self._dead_worker(rollouts)
            if dead not in rollouts.names:
                raise
            self.formed = False
            # whichever side's failure the driver heard first, the cause named is the dead worker
            why = str(e) if died else f"{dead} died during the weight sync (collective); before that, {e}"
            rollouts._restarted(rollouts.names.index(dead), why)  # forms the group again and pushes
            return
        sent, _ = results[0]
        stale = [w for w, r in enumerate(results[len(self.trainers):]) if r is None]
        if stale:
            self.formed = False
            rollouts._restarted(stale[0], f"{rollouts.names[stale[0]]} was restarted by Ray before the weight sync")
            return
        self.bytes = sent
