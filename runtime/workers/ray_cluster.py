"""Ray for one run: the cluster the driver joins or starts, its actors spawned, their calls
awaited (a dead, failed or late actor raises :class:`~rldsl.runtime.errors.WorkerError` naming
it), and the payload every actor starts from -- the config, the algorithm, the driver's import
path -- read back in the actor's process by :func:`actor_config`.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

import rldsl

from ..config import RunConfig
from ..errors import ConfigError, RewardError, WeightSyncError, WorkerError
from ..models.loading import disable_transformers_progress


# ----------------------------------------------------------------------------- what an actor starts from

def actor_payload(cfg: RunConfig, algo: rldsl.Algorithm, fn: rldsl.CompiledAlgorithm,
                  model_path: Path) -> dict[str, Any]:
    """What every actor is started with: the resolved config (its model the absolute ``model_path``),
    the algorithm, the rollout actors' GPUs, the driver's import path and fault injection."""
    d = cfg.distributed
    actor_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"path": os.path.abspath(str(model_path))})})
    gpus = d.gpus_per_worker if d.gpus_per_worker is not None else (1.0 if cfg.device == "cuda" else 0.0)
    return {"config": actor_cfg.model_dump_json(), "algorithm": algo, "compile": fn.compiled,
            "rollout_gpus": gpus,
            "faults": {k: v for k, v in os.environ.items() if k.startswith("RLDSL_FAULT")},  # faults.py
            "sys_path": [os.getcwd() if p == "" else os.path.abspath(p) for p in sys.path]}


def actor_config(payload: dict[str, Any]) -> RunConfig:
    """In an actor: the driver's import path (for ``module:function`` rewards), threads, quiet HF."""
    for entry in payload["sys_path"]:  # appended: the actor's own entries keep precedence
        if entry not in sys.path:
            sys.path.append(entry)
    os.environ.update(payload.get("faults", {}))  # the driver's fault injection (tests), faults.py
    cfg = RunConfig.model_validate_json(payload["config"]).frozen()  # resolved by the driver
    torch.set_num_threads(cfg.threads)
    disable_transformers_progress(errors_only=True)
    return cfg


# ----------------------------------------------------------------------------- the cluster

def _summary(exc: BaseException) -> str:
    """Ray's multi-line actor error, shortened to its sentences."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    keep = [ln for ln in lines if not re.match(r"^\w+: ", ln) or ln.startswith("The actor")]
    return " ".join(keep) or type(exc).__name__


class RayCluster:
    """Ray for one run: joins ``ray_address``, reuses an initialized Ray, or starts a local one."""

    def __init__(self, cfg: RunConfig, cpus_needed: int):
        try:
            import ray
        except ImportError:  # pragma: no cover - ray is a dependency of the dev/ray extras
            raise ConfigError("the distributed runtime needs Ray: pip install 'rldsl[ray]'") from None
        self.ray = ray
        self.owns = False
        d = cfg.distributed
        if not ray.is_initialized():
            if d.ray_address is not None:
                ray.init(address=d.ray_address, log_to_driver=False)
            else:
                if d.num_cpus is not None and d.num_cpus < cpus_needed:
                    raise ConfigError(f"distributed.num_cpus={d.num_cpus} is less than the "
                                      f"{cpus_needed} CPUs the actors reserve (one per torch "
                                      f"thread of each trainer rank and rollout worker)")
                cpus = d.num_cpus or max(os.cpu_count() or 1, cpus_needed)  # logical CPUs
                ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                         _node_ip_address="127.0.0.1", logging_level=logging.WARNING)
            self.owns = True
        self.actors: list[Any] = []

    def spawn(self, cls: type, *args: Any, max_restarts: int = 0, **options: Any) -> Any:
        actor = self.ray.remote(cls).options(max_restarts=max_restarts, **options).remote(*args)
        self.actors.append(actor)
        return actor

    def wait(self, calls: Sequence[tuple[str, Any]], timeout: float | None, what: str) -> list[Any]:
        """Results of ``(worker name, ObjectRef)`` calls, in order; a failure names its worker."""
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
        names = {ref: name for name, ref in calls}
        pending = list(names)
        results: dict[Any, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = self.ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                waiting = ", ".join(names[r] for r in pending)
                raise WorkerError(f"{what} timed out after {timeout:g} s (still waiting for {waiting})")
            ref = ready[0]
            try:
                results[ref] = self.ray.get(ref)
            except RayActorError as e:
                err = WorkerError(f"{names[ref]} died during {what}: {_summary(e)}")
                err.died = names[ref]  # RayRollouts restarts it
                err.restarting = isinstance(e, ActorUnavailableError)  # Ray is restarting it now
                raise err from None
            except RayTaskError as e:
                cause = getattr(e, "cause", None) or e
                if isinstance(cause, (RewardError, ConfigError)):  # worded for the user already
                    raise type(cause)(f"{names[ref]}: {cause}") from None
                hint = ""
                if ("timed out" in str(cause).lower() and names[ref].startswith("trainer")
                        and not isinstance(cause, WeightSyncError)):  # (names its bucket and timeout)
                    hint = ("\n(a collective waited longer than distributed.collective_timeout: "
                            "another trainer rank is stuck or gone)")
                raise WorkerError(f"{names[ref]} failed during {what}: {type(cause).__name__}: "
                                  f"{cause}{hint}") from None
        return [results[ref] for _, ref in calls]

    def close(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.actors.clear()
        if self.owns and self.ray.is_initialized():
            self.ray.shutdown()
            self.owns = False
