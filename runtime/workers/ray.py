"""The rollout and trainer sides on Ray actors: ``rldsl run SPEC --trainers N --rollout-workers M``.
:func:`start_ray_workers` starts them; each part has its module:

- ray_cluster.py: Ray for the run (joined, reused or started), every actor call awaited with
  ``ray.wait``: a dead, failed or late actor raises :class:`~rldsl.runtime.errors.WorkerError`
  naming it; the payload every actor starts from.
- trainer_actor.py / ray_trainers.py: N ``TrainerWorker`` actors, each one rank of a
  ``torch.distributed`` group holding a :class:`~rldsl.runtime.workers.fsdp.ShardedTrainer`
  (fsdp_rank.py starts it), and ``RayTrainers``, which drives them from the driver. Checkpoints:
  the driver writes them from the gathered full states, in the one-process format
  (full_state.py), so a run resumes on any number of ranks.
- rollout_actor.py / ray_rollouts.py: M ``RolloutWorker`` actors, each an engine and the reward,
  and ``RayRollouts``, which splits each round's prompts into M chunks, restarts a dead actor
  (``distributed.max_restarts``) with the weights it last held, and syncs weights from the
  trainers' gathered state.
- sync/: the weight sync's transport, chosen here once and given to both sides: Ray's object store
  (sync/object_store.py) or, with ``distributed.weight_sync = "collective"``, trainer rank 0
  broadcasting the weights bucket by bucket to every rollout worker over a process group made for
  the sync (sync/collective.py, sync/buckets.py).
"""
from __future__ import annotations

from pathlib import Path

import rldsl

from ..config import RunConfig
from .ray_cluster import RayCluster, actor_payload
from .ray_rollouts import RayRollouts
from .ray_trainers import RayTrainers
from .sync.transports import start_transport
from .trainer_actor import TrainerWorker


def start_ray_workers(cfg: RunConfig, algo: rldsl.Algorithm, fn: rldsl.CompiledAlgorithm,
                      model_path: Path, pad_id: int) -> tuple[RayRollouts, RayTrainers]:
    """Start the actors and wait until every model is loaded: (rollouts, trainers).

    ``cfg``: the resolved config (its reward checked by the driver already); ``model_path``:
    the policy folder (the toy model already warm-started by the driver).
    """
    d = cfg.distributed
    payload = actor_payload(cfg, algo, fn, model_path)
    m = max(1, d.rollout_workers)
    cluster = RayCluster(cfg, (d.trainers + m) * cfg.threads)
    try:
        trainer_gpus = 1 if cfg.device == "cuda" else 0
        ranks = [cluster.spawn(TrainerWorker, r, d.trainers, payload, num_cpus=cfg.threads, num_gpus=trainer_gpus)
                 for r in range(d.trainers)]
        sync, worker = start_transport(cfg, cluster, ranks)  # the weight sync, both sides'
        trainers = RayTrainers(cluster, cfg, ranks, str(model_path), sync)
        payload["sync_timeout"] = d.sync_timeout
        rollouts = RayRollouts(cluster, cfg, [
            cluster.spawn(worker, w, payload, num_cpus=cfg.threads, num_gpus=payload["rollout_gpus"],
                          max_restarts=d.max_restarts) for w in range(m)], pad_id, sync)
        calls = rollouts.start() + trainers.start()
        cluster.wait(calls, d.call_timeout, "start-up")  # a stuck rendezvous fails by the collective timeout
    except BaseException:
        cluster.close()
        raise
    return rollouts, trainers
