"""The rollout and trainer sides on Ray actors: ``rldsl run SPEC --trainers N --rollout-workers M``.

- ``RayTrainers``: N ``TrainerWorker`` actors, each one rank of a ``torch.distributed`` group
  holding a :class:`~rldsl.runtime.workers.fsdp.ShardedTrainer` (gloo on CPU, nccl on GPU;
  rendezvous on 127.0.0.1, or on rank 0's node address when the ranks span nodes; the store
  serves on the socket rank 0 bound there, never on every interface).
- ``RayRollouts``: M ``RolloutWorker`` actors, each an engine (``hf`` or ``vllm``, CPU or GPU)
  and the reward: the P prompts of a round are split into M contiguous chunks that every
  actor samples *and scores*. With M > 1, chunk w samples with
  ``step_seed(round seed, w, 0, "chunk")``: reproducible for a given M, not the samples of M = 1.
- Weight sync: every rank joins a full-state-dict gather; rank 0's dict goes to Ray's
  object store and from there to every rollout actor, within ``distributed.sync_timeout``.
- Checkpoints: the driver writes them from the gathered full states, in the one-process
  format, so a run resumes on any number of ranks.
- Faults: every call is awaited with ``ray.wait``; a dead, failed or late actor raises
  :class:`~rldsl.runtime.errors.WorkerError` naming it. A rollout actor that dies is restarted
  (``distributed.max_restarts`` times each; Ray runs its ``__init__`` again): it is given the
  weights it last held and the call is made again (the same seeds: the same samples). Each
  actor checks the weights version of every call against the one it holds, so an actor that
  Ray restarted unnoticed between two calls is never sampled with its starting weights.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

import rldsl

from ..batch import RolloutBatch
from ..records.checkpoint import Checkpoint, read_weights, saveable
from ..config import RunConfig
from ..rollout.engines.base import SamplingParams
from ..errors import ConfigError, RewardError, WorkerError
from ..models.loading import disable_transformers_progress, policy_on_meta, with_tied
from ..recipe import episode_runner, reward_fn, rollout_engine, with_lora
from ..rewards.functions import RewardResult
from ..records.rng import step_seed
from ..train.trainer import TrainBatch
from ..train.value_model import ValueModel
from .base import Generation, TrainerState
from .fsdp import ShardedTrainer, start_rank
from .local import LocalRollouts


# ----------------------------------------------------------------------------- actors

def _prepare_process(payload: dict[str, Any]) -> RunConfig:
    """In an actor: the driver's import path (for ``module:function`` rewards), threads, quiet HF."""
    for entry in payload["sys_path"]:  # appended: the actor's own entries keep precedence
        if entry not in sys.path:
            sys.path.append(entry)
    cfg = RunConfig.model_validate_json(payload["config"]).frozen()  # resolved by the driver
    torch.set_num_threads(cfg.threads)
    disable_transformers_progress(errors_only=True)
    return cfg




class TrainerWorker:
    """One trainer rank (a Ray actor): FSDP2-sharded policy, reference, critic and optimizers."""

    def __init__(self, rank: int, world: int, payload: dict[str, Any]):
        self.cfg = _prepare_process(payload)
        self.rank, self.world, self.payload = rank, world, payload
        if self.cfg.device == "cuda":
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")
        self.trainer: ShardedTrainer | None = None
        self.pending: TrainBatch | None = None
        self.listener: socket.socket | None = None  # rank 0: where the group's store serves

    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def rendezvous(self, local: bool) -> tuple[str, int]:
        """Rank 0: the group's address, a port bound and held here until the store serves on it
        (never a port probed and let go, which another process may take meanwhile). ``local``:
        every rank is on this node, so the store listens on 127.0.0.1, else on the node's address;
        never on every interface."""
        import ray
        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        self.listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        return host, int(self.listener.getsockname()[1])

    def setup(self, host: str, port: int) -> int:
        """Join the process group, load and shard the models; returns the parameter count."""
        fd = self.listener.fileno() if self.listener is not None else None
        self.trainer = start_rank(self.cfg, self.payload["algorithm"], self.payload["compile"],
                                  rank=self.rank, world=self.world, device=self.device, host=host, port=port,
                                  listen_fd=fd)
        return sum(p.numel() for p in self.trainer.policy.parameters())

    def estimate(self, data: tuple[RolloutBatch, Tensor]) -> dict[str, float]:
        rollout, rewards = data
        assert self.trainer is not None
        self.pending = self.trainer.estimate(rollout.to(self.device), rewards.to(self.device))
        return self.pending.metrics

    def update(self, seed: int) -> dict[str, Any]:
        t = self.trainer
        assert t is not None and self.pending is not None, "update() before estimate()"
        m = t.update(self.pending, torch.Generator().manual_seed(seed))
        t.step_schedule()
        self.pending = None
        return {"metrics": m, "lr": float(t.optimizer.param_groups[0]["lr"])}

    def full_weights(self) -> tuple[None, dict[str, Tensor] | None]:
        """(status, full state dict on rank 0): a collective over the ranks."""
        assert self.trainer is not None
        return None, self.trainer.full_weights()

    def checkpoint_state(self) -> dict[str, Any] | None:
        """Full (unsharded) model and optimizer states, on rank 0: a collective over the ranks."""
        assert self.trainer is not None
        return self.trainer.full_state()

    def load_state(self, state: dict[str, Any]) -> None:
        """Load full states (a checkpoint of any number of ranks) into this rank's shards."""
        assert self.trainer is not None
        self.trainer.load_full_state(state)


class RolloutWorker:
    """One rollout actor: an engine and the reward; samples and scores its chunk of prompts."""

    def __init__(self, index: int, payload: dict[str, Any]):
        cfg = _prepare_process(payload)
        self.index = index
        gpus = payload["rollout_gpus"]
        engine = rollout_engine(cfg, cfg.model.path, "cuda" if gpus > 0 else "cpu", gpus=gpus)
        self.local = LocalRollouts(engine, reward_fn(cfg), episode_runner(cfg, cfg.model.path))
        self.version = 0  # the weights held: 0 = the model folder's, n = the driver's n-th sync

    def ready(self) -> int:
        return self.index

    def generate(self, version: int, prompts: list[str | tuple], answers: list[str], params: SamplingParams,
                 reward_prompts: list[str] | None = None, score: bool = True) -> Generation | None:
        """The chunk's samples; None when this actor does not hold weights ``version`` (Ray
        restarted it since its last sync)."""
        if version != self.version:
            return None
        return self.local.generate(prompts, answers, params, reward_prompts, score)

    def score(self, batch: RolloutBatch, reward_prompts: list[str] | None = None) -> RewardResult:
        return self.local.score(batch, reward_prompts)

    def update_weights(self, state: dict[str, Tensor], version: int, policy_version: int) -> int:
        """``version``: the driver's sync count (a restarted actor holds 0); ``policy_version``:
        the optimizer steps the weights have had."""
        self.local.load_weights(state.items(), policy_version)
        self.version = version
        return version

    def engine_weights(self) -> dict[str, Tensor]:
        """The engine's current weights on CPU, HF-named: a probe of what the weight sync
        delivered (the hf engine's state dict; vLLM's ``read_weights``, read through its kernels)."""
        engine = self.local.engine
        if callable(getattr(engine, "read_weights", None)):
            return engine.read_weights()
        model = getattr(engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"engine_weights() cannot read a {type(engine).__name__}")
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- driver side

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
                if "timed out" in str(cause).lower() and names[ref].startswith("trainer"):
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


class _StateDict:
    """A saved state dict that quacks like the optimizer/scheduler it came from."""

    def __init__(self, state: dict[str, Any] | None):
        self._state = state

    def state_dict(self) -> dict[str, Any] | None:
        return self._state


@dataclasses.dataclass
class _Estimated:
    """What the driver keeps of an estimated batch (the batch itself stays on the ranks)."""

    metrics: dict[str, float]


class RayTrainers:
    """N :class:`TrainerWorker` actors behind the ``Trainers`` interface (base.py)."""

    def __init__(self, cluster: RayCluster, cfg: RunConfig, payload: dict[str, Any], model_path: str):
        self.cluster, self.cfg, self.model_path = cluster, cfg, model_path
        n = cfg.distributed.trainers
        self.world_size = n
        gpus = 1 if cfg.device == "cuda" else 0
        self.actors = [cluster.spawn(TrainerWorker, r, n, payload, num_cpus=cfg.threads, num_gpus=gpus)
                       for r in range(n)]
        self.names = [f"trainer rank {r}" for r in range(n)]
        self._lr = cfg.train.lr

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

    def update(self, estimated: _Estimated, seed: int) -> dict[str, float]:
        out = self._all("update", seed, what="the update")[0]
        self._lr = out["lr"]
        return out["metrics"]

    @property
    def lr(self) -> float:
        return self._lr

    def weights(self) -> Any:
        """An ObjectRef to the full state dict (rank 0), gathered within ``sync_timeout``."""
        calls = [(name, a.full_weights.options(num_returns=2).remote())
                 for name, a in zip(self.names, self.actors)]
        self.cluster.wait([(name, refs[0]) for name, refs in calls], self.cfg.distributed.sync_timeout,
                          "the weight sync (gather)")
        return calls[0][1][1]

    def _on_meta(self) -> torch.nn.Module:
        """The policy's module tree on the meta device, with the run's LoRA layers if any: the
        names of the gathered state (``base_layer`` / ``lora_A`` / ``lora_B`` under LoRA)."""
        policy = policy_on_meta(self.model_path)
        with torch.device("meta"):
            return with_lora(self.cfg, policy)[0]

    def checkpoint_state(self) -> TrainerState:
        state = self._all("checkpoint_state", what="the checkpoint gather")[0]
        policy = self._on_meta()
        policy.load_state_dict(with_tied(saveable(state["policy"]), policy), assign=True)
        policy.tie_weights()
        critic = None
        if state["critic"] is not None:
            with torch.device("meta"):
                critic = ValueModel(self._on_meta())
            critic.load_state_dict(saveable(state["critic"]), assign=True)
        return TrainerState(policy, _StateDict(state["optimizer"]), _StateDict(state["scheduler"]),
                            critic, _StateDict(state["critic_optimizer"]), state["algorithm"])

    def load_checkpoint(self, c: Checkpoint) -> None:
        state = {"policy": read_weights(c.policy_path),
                 "critic": read_weights(c.critic_path) if c.critic_path is not None else None,
                 "optimizer": c.optimizer, "critic_optimizer": c.critic_optimizer,
                 "scheduler": c.scheduler, "algorithm": c.extra.get("algorithm", {})}
        self._all("load_state", self.cluster.ray.put(state), what=f"loading {c.path.name}")

    def close(self) -> None:
        self.cluster.close()


def _merge_rewards(results: Sequence[RewardResult]) -> RewardResult:
    """Rewards of consecutive chunks of one batch, as if scored at once."""
    if len(results) == 1:
        return results[0]
    keys = list(results[0].components)
    first = next((r.first_error for r in results if r.first_error is not None), None)
    return RewardResult(torch.cat([r.rewards for r in results]),
                        {k: torch.cat([r.components[k] for r in results]) for k in keys},
                        sum(r.num_errors for r in results), first)


class RayRollouts:
    """M :class:`RolloutWorker` actors behind the ``Rollouts`` interface (base.py)."""

    def __init__(self, cluster: RayCluster, cfg: RunConfig, payload: dict[str, Any], pad_id: int):
        self.cluster, self.cfg, self.pad_id = cluster, cfg, pad_id
        m = max(1, cfg.distributed.rollout_workers)
        gpus = payload["rollout_gpus"]
        self.max_restarts = cfg.distributed.max_restarts
        self.actors = [cluster.spawn(RolloutWorker, w, payload, num_cpus=cfg.threads, num_gpus=gpus,
                                     max_restarts=self.max_restarts) for w in range(m)]
        self.names = [f"rollout worker {w}" for w in range(m)]
        self.restarts = [0] * m  # per actor, counted against distributed.max_restarts
        self.version, self.weights = 0, None  # the weights every actor should hold (an ObjectRef)
        self.policy_version = 0  # ... and their policy version (optimizer steps)

    def _run(self, what: str, timeout: float | None, call: Any) -> list[Any]:
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
                self.cluster.wait([(name, actor.update_weights.remote(self.weights, self.version,
                                                                         self.policy_version))],
                                  d.sync_timeout, "the weight sync after its restart")
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
            p = params
            if len(chunks) > 1 and params.seed is not None:
                p = dataclasses.replace(params, seed=step_seed(params.seed, w, 0, "chunk"))
            rp = None if reward_prompts is None else reward_prompts[lo:hi]
            return self.actors[w].generate.remote(self.version, prompts[lo:hi], answers[lo:hi], p, rp, score)

        t0 = time.perf_counter()
        gens: list[Generation] = [g for w, g in enumerate(self._run("the rollout", self.cfg.distributed.call_timeout,
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

        results = self._run("the scoring", self.cfg.distributed.call_timeout, call)
        return _merge_rewards([r for w, r in enumerate(results) if len(bounds[w])])

    def load_weights(self, weights: Any, version: int) -> None:
        """Every actor loads the trainers' full state dict (an ObjectRef), policy ``version``,
        within ``sync_timeout``."""
        self.version, self.weights, self.policy_version = self.version + 1, weights, version
        self._run("the weight sync", self.cfg.distributed.sync_timeout,
                  lambda w: self.actors[w].update_weights.remote(self.weights, self.version, self.policy_version))

    def sample_in_segments(self, tokens: int, refresh: Any) -> None:
        """Partial rollouts run in one process (the run is refused before it starts)."""
        raise ConfigError("rollout.partial runs in one process: not with Ray rollout workers")

    def close(self) -> None:
        self.cluster.close()


def start_ray_workers(cfg: RunConfig, algo: rldsl.Algorithm, fn: rldsl.CompiledAlgorithm,
                      model_path: Path, pad_id: int) -> tuple[RayRollouts, RayTrainers]:
    """Start the actors and wait until every model is loaded: (rollouts, trainers).

    ``cfg``: the resolved config (its reward checked by the driver already); ``model_path``:
    the policy folder (the toy model already warm-started by the driver).
    """
    d = cfg.distributed
    actor_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"path": os.path.abspath(str(model_path))})})
    gpus = d.gpus_per_worker if d.gpus_per_worker is not None else (1.0 if cfg.device == "cuda" else 0.0)
    payload = {"config": actor_cfg.model_dump_json(), "algorithm": algo, "compile": fn.compiled,
               "rollout_gpus": gpus,
               "sys_path": [os.getcwd() if p == "" else os.path.abspath(p) for p in sys.path]}
    cluster = RayCluster(cfg, (d.trainers + max(1, d.rollout_workers)) * cfg.threads)
    try:
        trainers = RayTrainers(cluster, cfg, payload, str(model_path))
        rollouts = RayRollouts(cluster, cfg, payload, pad_id)
        calls = rollouts.start() + trainers.start()
        cluster.wait(calls, d.call_timeout, "start-up")  # a stuck rendezvous fails by the collective timeout
    except BaseException:
        cluster.close()
        raise
    return rollouts, trainers
