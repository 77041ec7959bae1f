"""The weight sync's transport on Ray, chosen once at start-up from the config (workers/ray.py):
Ray's object store, or the collective broadcast in buckets."""
from __future__ import annotations

from typing import Any

from ...config import RunConfig
from .. import rollout_actor
from ..ray_cluster import RayCluster
from .base import Transport
from .collective import CollectiveSync, RolloutWorker
from .object_store import ObjectStore


def transport_name(cfg: RunConfig) -> str:
    """``distributed.weight_sync`` resolved: 'auto' is 'collective' where it was measured faster
    and is tested (a synchronous CPU run, hf engine, full weights: docs/scaling.md, section 6),
    else 'object_store'."""
    chosen = cfg.distributed.weight_sync
    if chosen != "auto":
        return chosen
    r = cfg.rollout
    tested = (cfg.device == "cpu" and r.engine == "hf" and cfg.model.lora.rank == 0
              and r.max_staleness == 0 and not r.partial)
    return "collective" if tested else "object_store"


def start_transport(cfg: RunConfig, cluster: RayCluster, ranks: list[Any]) -> tuple[Transport, type]:
    """(the transport both sides are given, the rollout actor class it needs) for the trainer
    ranks' actors ``ranks``: the collective sync's rollout workers join its group."""
    if transport_name(cfg) == "collective":
        return CollectiveSync(cluster, cfg, ranks), RolloutWorker
    return ObjectStore(cluster, cfg.distributed.sync_timeout), rollout_actor.RolloutWorker
