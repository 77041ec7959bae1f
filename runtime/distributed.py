"""The distributed runtime: FSDP2 trainer ranks and rollout actors on Ray.

``rldsl run SPEC --trainers N --rollout-workers M`` runs the same step as the one-process
run (loop.py); only the two groups the step talks to (groups.py) are different:

- **trainer group** (``RayTrainerGroup``): N Ray actors (``TrainerWorker``) forming one
  ``torch.distributed`` process group (gloo on CPU, nccl on GPU; rendezvous on 127.0.0.1,
  or on rank 0's node address when the ranks span nodes, with a free port). Each rank
  holds the policy (and reference, critic) sharded with FSDP2 ``fully_shard`` per
  transformer block and at the root, with its shard of the optimizer state. The trainer
  is :class:`ShardedTrainer`, the one-process :class:`~rldsl.runtime.trainer.Trainer` with
  its data-parallel hooks filled in (below): it calls the compiled algorithm only.
- **rollout group** (``RayRolloutGroup``): M Ray actors (``RolloutWorker``), each holding
  an engine (``hf`` on CPU, ``vllm`` with ``rollout.engine=vllm`` on GPU) and the reward
  function: the P prompts of a round are split into M contiguous chunks, every actor
  samples *and scores* its chunk, so rewards are computed next to the samples, in
  parallel, off the trainers.

Exactness (N ranks compute the update of one rank on the same data)
    Rows are split by whole prompt groups (contiguous chunks of each minibatch's groups),
    so group-level aggregation (prompt_mean) and baselines never straddle ranks. Old /
    reference logprobs and values are computed on each rank's rows and assembled by an
    all-reduce of zero-padded [B, T] tensors (x + 0 = x: exact); every rank then runs the
    algorithm's ``estimate`` on the whole batch and rank 0's advantages are broadcast, so
    every rank takes the same skip decisions. In the update each rank calls ``fn.loss``
    on its rows with ``denominator=`` the all-reduced sum of ``fn.denominator`` over
    ranks; FSDP's gradient reduction is set to a plain sum (``set_gradient_divide_factor
    (1.0)``; gloo has no pre-multiplied sum, so ``set_force_sum_reduction_for_comms``),
    hence the summed gradient is the gradient of the one-rank loss. A rank that gets no
    group of a minibatch runs a zero-weighted copy of another rank's first group, so every
    rank enters the same collectives. Gradient clipping uses the global norm (DTensor).

Data
    The sampling seed of every round is ``loop.step_seed(seed, step, round)``. With one
    rollout worker that seed samples the whole batch, exactly as the one-process engine:
    the data are identical to a one-process run. With M > 1 workers chunk w samples with
    ``step_seed(seed_of_the_round, w, 0, "chunk")``: deterministic (resume reproduces it)
    for a given M, but not the samples of M = 1.

Weight sync
    After each update every rank joins a full-state-dict gather
    (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``); rank 0's dict goes
    to Ray's object store and from there to every rollout actor's
    ``engine.update_weights``. The whole sync is bounded by ``distributed.sync_timeout``.

Checkpoints
    Written by the driver with ``checkpoint.save_checkpoint`` (the format of a one-process
    run: HF layout, safetensors): the ranks gather the full model state dict and the full
    optimizer state dict (``get_optimizer_state_dict(full_state_dict=True)``, re-keyed by
    parameter index as ``Optimizer.state_dict()`` does), so a checkpoint loads into any
    number of ranks, including the one-process trainer, and vice versa.

Faults
    Every actor call is awaited with ``ray.wait``: an actor that dies (``RayActorError``),
    fails (an exception inside it, e.g. a collective that exceeded
    ``distributed.collective_timeout``) or exceeds its time limit raises
    :class:`~rldsl.runtime.groups.WorkerError` naming it ("rollout worker 1 died: ...",
    "trainer rank 0 failed: ..."). ``loop.train`` adds where the last complete checkpoint
    is; the actors are killed and a Ray cluster started by the run is shut down.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import re
import socket
import sys
import time
import types
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

import rldsl

from .checkpoint import Checkpoint
from .config import ConfigError, RunConfig
from .groups import (Generation, LocalRolloutGroup, StateDictHolder, TrainerState, WorkerError,
                     merge_rewards)
from .logprobs import token_logprobs
from .rewards import RewardError, RewardFn
from .trainer import Trainer, TrainBatch, _sub_rollout, model_inputs
from .types import RolloutBatch, SamplingParams

__all__ = ["ShardedTrainer", "TrainerWorker", "RolloutWorker", "RayCluster", "RayTrainerGroup",
           "RayRolloutGroup", "build_distributed", "shard_module", "transformer_blocks"]

LOGPROBS_METHOD = "rldsl_token_logprobs"
_BLOCK_LISTS = ("layers", "h", "blocks", "block")
# metrics of fn.loss already divided by the global denominator: their sum over ranks is exact
_SUMMED = ("loss", "pg_loss", "value_loss")
# the same on every rank (computed from the global gradient)
_REPLICATED = ("grad_norm", "critic_grad_norm")


# ----------------------------------------------------------------------------- FSDP2

def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of an HF causal LM (or a ValueModel's body): one FSDP unit each."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and name.rsplit(".", 1)[-1] in _BLOCK_LISTS:
            return list(module)
    raise ValueError(f"{type(model).__name__}: no list of transformer blocks found (looked for "
                     f"a ModuleList named one of {_BLOCK_LISTS})")


def shard_module(module: nn.Module, mesh: Any, *, mixed_precision: bool, gloo: bool) -> nn.Module:
    """``fully_shard`` every transformer block, then the root; gradients are summed over ranks."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if mixed_precision else MixedPrecisionPolicy())
    for block in transformer_blocks(module):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(module, mesh=mesh, mp_policy=mp)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, not mean: each rank holds a part of one loss
            if gloo:
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return module


def _attach_logprobs(model: nn.Module) -> None:
    """Give the (FSDP root) model a method running ``token_logprobs`` under its FSDP hooks.

    ``token_logprobs`` calls the backbone and reads the LM head's weight directly, outside
    the root ``forward``; registering it as an FSDP forward method makes the root's
    parameters (embedding, final norm, head) unsharded while it runs, and their gradients
    reduce-scattered after the backward, as for ``forward``.
    """
    from torch.distributed.fsdp import register_fsdp_forward_method

    def rldsl_token_logprobs(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return token_logprobs(self, *args, **kwargs)

    setattr(model, LOGPROBS_METHOD, types.MethodType(rldsl_token_logprobs, model))
    register_fsdp_forward_method(model, LOGPROBS_METHOD)


def _aliases(model: nn.Module) -> list[list[str]]:
    """Names of parameters shared under several names (tied embeddings)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _with_tied(state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """Add the tied names a checkpoint leaves out (``save_pretrained`` stores one of them)."""
    state = dict(state)
    for names in _aliases(model):
        have = [n for n in names if n in state]
        if have:
            for n in names:
                state.setdefault(n, state[have[0]])
    return state


def _own_storage(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Tensors that are views into a larger buffer (gathered shards) copied out: safetensors
    refuses to save a tensor that does not cover its whole storage."""
    out = {}
    for k, v in state.items():
        whole = v.is_contiguous() and v.storage_offset() == 0 and \
            v.untyped_storage().nbytes() == v.numel() * v.element_size()
        out[k] = v if whole else v.clone(memory_format=torch.contiguous_format)
    return out


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in ``Optimizer.state_dict()`` index order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _index_keyed(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A full optimizer state dict keyed by parameter name -> keyed by index (one-process format)."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[k]: v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [index[k] for k in g["params"]]} for g in osd["param_groups"]]}


def _name_keyed(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`_index_keyed`."""
    return {"state": {names[int(k)]: v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [names[int(k)] for k in g["params"]]} for g in osd["param_groups"]]}


# ----------------------------------------------------------------------------- trainer

class ShardedTrainer(Trainer):
    """The :class:`Trainer` on one rank of an FSDP2 group (see the module docstring).

    Only the data-parallel hooks change; the loss is the compiled algorithm's, as on one rank.
    """

    def __init__(self, *args: Any, rank: int, world: int, device: torch.device, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.rank, self.world, self.device = rank, world, device

    # -- forward

    def _token_logprobs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor,  # type: ignore[override]
                        num_response_tokens: int, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        return getattr(model, LOGPROBS_METHOD)(input_ids.to(self.device), attention_mask.to(self.device),
                                               num_response_tokens, **kwargs)

    def _groups(self, rows: Tensor, group_size: int) -> tuple[Tensor, float]:
        groups = rows.view(-1, group_size)
        mine = groups.tensor_split(self.world)[self.rank]
        if len(mine) == 0:  # fewer groups than ranks: a zero-weighted copy keeps collectives in step
            return groups[:1].reshape(-1), 0.0
        return mine.reshape(-1), 1.0

    def _score_forward(self, rollout: RolloutBatch) -> tuple[Tensor, Tensor | None, Tensor | None]:
        B = len(rollout)
        rows, share = self._groups(torch.arange(B), rollout.group_size)
        local = super()._score_forward(_sub_rollout(rollout, rows))
        return tuple(None if t is None else self._assemble(t, rows, B, share) for t in local)  # type: ignore[return-value]

    def _assemble(self, local: Tensor, rows: Tensor, B: int, share: float) -> Tensor:
        """[b, T] rows of this rank -> [B, T] of every rank (each row written by one rank)."""
        full = local.new_zeros((B,) + tuple(local.shape[1:]))
        if share:
            full[rows.to(full.device)] = local
        dist.all_reduce(full)
        return full

    @torch.no_grad()
    def score(self, rollout: RolloutBatch, rewards: Tensor) -> TrainBatch:
        tb = super().score(rollout, rewards)
        for name in ("advantages", "returns", "mask"):  # one decision for every rank
            t = getattr(tb, name)
            buf = t.contiguous()
            dist.broadcast(buf, src=0)
            if buf is not t:
                setattr(tb, name, buf)
        return tb

    # -- update hooks (Trainer._step)

    def _local_rows(self, rows: Tensor, group_size: int) -> tuple[Tensor, float]:
        return self._groups(rows, group_size)

    def _global_denominator(self, local: Tensor, share: float) -> Tensor:
        total = (local.detach().float() * share).to(self.device)
        dist.all_reduce(total)
        return total

    def _all_finite(self, loss: Tensor) -> bool:
        bad = torch.tensor([0.0 if bool(torch.isfinite(loss)) else 1.0], device=self.device)
        dist.all_reduce(bad)
        return bool(bad.item() == 0.0)

    def _reduce_metrics(self, metrics: dict[str, float], mask: Tensor, share: float) -> dict[str, float]:
        """Sums for the terms over the global denominator, min/max for extremes, token-weighted
        means for the per-token averages (weight: this rank's loss-mask tokens)."""
        w = float(mask.sum()) * share
        keys = sorted(metrics)
        sums = [k for k in keys if k not in _REPLICATED and not k.endswith(("_max", "_min"))]
        vec = torch.tensor([metrics[k] * (share if k in _SUMMED else w) for k in sums] + [w],
                           dtype=torch.float64, device=self.device)
        dist.all_reduce(vec)
        out = dict(metrics)
        total_w = float(vec[-1])
        for k, v in zip(sums, vec[:-1].tolist()):
            out[k] = v if k in _SUMMED else v / max(total_w, 1.0)
        for suffix, op, neutral in (("_max", dist.ReduceOp.MAX, -float("inf")),
                                    ("_min", dist.ReduceOp.MIN, float("inf"))):
            ks = [k for k in keys if k.endswith(suffix)]
            if ks:
                t = torch.tensor([metrics[k] if share else neutral for k in ks], dtype=torch.float64,
                                 device=self.device)
                dist.all_reduce(t, op=op)
                out.update(zip(ks, t.tolist()))
        return out


# ----------------------------------------------------------------------------- actors

def _prepare_process(payload: dict[str, Any]) -> RunConfig:
    """In an actor: the driver's import path (for ``module:function`` rewards), threads, quiet HF."""
    for entry in payload["sys_path"]:  # appended: the actor's own entries keep precedence
        if entry not in sys.path:
            sys.path.append(entry)
    cfg = RunConfig.model_validate_json(payload["config"])
    torch.set_num_threads(cfg.threads)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return cfg


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _batch_to(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    if device.type == "cpu":
        return batch
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device)
                                         for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), Tensor)})


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

    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def rendezvous(self) -> tuple[str, int]:
        import ray
        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, host: str, port: int) -> int:
        """Join the process group, load and shard the models; returns the parameter count."""
        from torch.distributed.device_mesh import init_device_mesh

        from .loop import _load_model, _seed_all, build_trainer
        cfg = self.cfg
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world,
                                timeout=datetime.timedelta(seconds=cfg.distributed.collective_timeout))
        mesh = init_device_mesh(self.device.type, (self.world,))
        algo = self.payload["algorithm"]
        _seed_all(cfg.seed)
        fn = rldsl.compile(algo, compile=self.payload["compile"])
        policy, _, _ = _load_model(cfg)
        policy.to(self.device)
        if cfg.distributed.activation_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mp = cfg.distributed.mixed_precision
        mixed = mp == "bf16" or (mp == "auto" and self.device.type == "cuda")

        def prepare(policy: nn.Module, reference: nn.Module | None, critic: nn.Module | None) -> None:
            for module, logprobs in ((policy, True), (reference, True), (critic, False)):
                if module is not None:
                    shard_module(module, mesh, mixed_precision=mixed, gloo=backend == "gloo")
                    if logprobs:
                        _attach_logprobs(module)

        self.trainer = build_trainer(cfg, algo, fn, policy, prepare=prepare, trainer_cls=ShardedTrainer,
                                     rank=self.rank, world=self.world, device=self.device)
        return sum(p.numel() for p in policy.parameters())

    def score(self, data: tuple[RolloutBatch, Tensor]) -> dict[str, float]:
        rollout, rewards = data
        assert self.trainer is not None
        self.pending = self.trainer.score(_batch_to(rollout, self.device), rewards.to(self.device))
        return self.pending.metrics

    def update(self, seed: int) -> dict[str, Any]:
        t = self.trainer
        assert t is not None and self.pending is not None, "update() before score()"
        m = t.update(self.pending, torch.Generator().manual_seed(seed))
        t.step_schedule()
        self.pending = None
        return {"metrics": m, "lr": float(t.optimizer.param_groups[0]["lr"])}

    def full_weights(self) -> tuple[None, dict[str, Tensor] | None]:
        """(status, full state dict on rank 0): a collective over the ranks."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        assert self.trainer is not None
        sd = get_model_state_dict(self.trainer.policy,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return None, (sd if self.rank == 0 else None)

    def checkpoint_state(self) -> dict[str, Any] | None:
        """Full (unsharded) model and optimizer states, on rank 0: a collective over the ranks."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        t = self.trainer
        assert t is not None
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        out: dict[str, Any] = {
            "policy": get_model_state_dict(t.policy, options=opts),
            "optimizer": get_optimizer_state_dict(t.policy, t.optimizer, options=opts),
            "critic": None, "critic_optimizer": None}
        if t.critic is not None:
            out["critic"] = get_model_state_dict(t.critic, options=opts)
            out["critic_optimizer"] = get_optimizer_state_dict(t.critic, t.critic_optimizer, options=opts)
        if self.rank != 0:
            return None
        out["optimizer"] = _index_keyed(out["optimizer"], _param_names(t.policy, t.optimizer))
        if t.critic is not None:
            out["critic_optimizer"] = _index_keyed(out["critic_optimizer"],
                                                   _param_names(t.critic, t.critic_optimizer))
        out["scheduler"] = t.scheduler.state_dict() if t.scheduler is not None else None
        out["algorithm"] = t.fn.state_dict()
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        """Load full states (a checkpoint of any number of ranks) into this rank's shards."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)
        t = self.trainer
        assert t is not None
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(t.policy, _with_tied(state["policy"], t.policy), options=opts)
        set_optimizer_state_dict(t.policy, t.optimizer,
                                 _name_keyed(state["optimizer"], _param_names(t.policy, t.optimizer)),
                                 options=opts)
        if t.critic is not None:
            if state.get("critic") is None or state.get("critic_optimizer") is None:
                raise ValueError("the checkpoint holds no critic (or no critic optimizer) state")
            set_model_state_dict(t.critic, state["critic"], options=opts)
            set_optimizer_state_dict(t.critic, t.critic_optimizer,
                                     _name_keyed(state["critic_optimizer"],
                                                 _param_names(t.critic, t.critic_optimizer)),
                                     options=opts)
        if t.scheduler is not None:
            if state.get("scheduler") is None:
                raise ValueError("the checkpoint holds no scheduler state")
            t.scheduler.load_state_dict(state["scheduler"])
        t.fn.load_state_dict(state.get("algorithm") or {})


class RolloutWorker:
    """One rollout actor: an engine and the reward; samples and scores its chunk of prompts."""

    def __init__(self, index: int, payload: dict[str, Any]):
        from .loop import _load_model
        cfg = _prepare_process(payload)
        self.index = index
        gpus = payload["rollout_gpus"]
        if cfg.rollout.engine == "vllm":
            from .vllm_engine import VLLMEngine
            self.engine: Any = VLLMEngine(cfg.model.path, tensor_parallel_size=max(1, int(gpus)),
                                          dtype=cfg.model.dtype, seed=cfg.seed,
                                          weight_sync_timeout=cfg.distributed.sync_timeout)
        else:
            from .engine import HFEngine
            model, tok, _ = _load_model(cfg)
            self.engine = HFEngine(model.eval(), tok, device="cuda" if gpus > 0 else "cpu")
        self.reward = RewardFn(payload["reward"], on_error=cfg.reward.on_error)
        self._local = LocalRolloutGroup(self)  # type: ignore[arg-type]  # reads .engine / .reward

    def ready(self) -> int:
        return self.index

    def generate(self, prompts: list[str], answers: list[str], params: SamplingParams) -> Generation:
        return self._local.generate(prompts, answers, params)

    def update_weights(self, state: dict[str, Tensor]) -> None:
        self.engine.update_weights(state.items())


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

    def spawn(self, cls: type, *args: Any, **options: Any) -> Any:
        actor = self.ray.remote(cls).options(max_restarts=0, **options).remote(*args)
        self.actors.append(actor)
        return actor

    def wait(self, calls: Sequence[tuple[str, Any]], timeout: float | None, what: str) -> list[Any]:
        """Results of ``(worker name, ObjectRef)`` calls, in order; a failure names its worker."""
        from ray.exceptions import RayActorError, RayTaskError
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
                raise WorkerError(f"{names[ref]} died during {what}: {_summary(e)}") from None
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


@dataclasses.dataclass
class _Scored:
    """What the driver keeps of a scored batch (the batch itself stays on the ranks)."""

    metrics: dict[str, float]


class RayTrainerGroup:
    """N :class:`TrainerWorker` actors behind the trainer-group interface (groups.py)."""

    def __init__(self, cluster: RayCluster, cfg: RunConfig, payload: dict[str, Any], model_path: str):
        self.cluster, self.cfg, self.model_path = cluster, cfg, model_path
        n = cfg.distributed.trainers
        self.world_size = n
        gpus = 1 if cfg.device == "cuda" else 0
        self.actors = [cluster.spawn(TrainerWorker, r, n, payload, num_cpus=cfg.threads, num_gpus=gpus)
                       for r in range(n)]
        self.names = [f"trainer rank {r}" for r in range(n)]
        self._lr = cfg.train.lr
        self._setup: list[Any] = []

    def start(self) -> list[tuple[str, Any]]:
        """Rendezvous and begin loading (returns the calls to wait for)."""
        c, timeout = self.cluster, self.cfg.distributed.call_timeout
        nodes = c.wait(self._calls("node"), timeout, "start-up")
        host, port = c.wait([(self.names[0], self.actors[0].rendezvous.remote())], timeout, "start-up")[0]
        if len(set(nodes)) == 1:
            host = "127.0.0.1"
        return [(name, a.setup.remote(host, port)) for name, a in zip(self.names, self.actors)]

    def _calls(self, method: str, *args: Any) -> list[tuple[str, Any]]:
        return [(name, getattr(a, method).remote(*args)) for name, a in zip(self.names, self.actors)]

    def _all(self, method: str, *args: Any, what: str) -> list[Any]:
        return self.cluster.wait(self._calls(method, *args), self.cfg.distributed.call_timeout, what)

    def score(self, rollout: RolloutBatch, rewards: Tensor) -> _Scored:
        data = self.cluster.ray.put((rollout, rewards))
        return _Scored(self._all("score", data, what="old/reference logprobs")[0])

    def update(self, scored: _Scored, seed: int) -> dict[str, float]:
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

    def checkpoint_state(self) -> TrainerState:
        state = self._all("checkpoint_state", what="the checkpoint gather")[0]
        policy = self._policy_module(state["policy"])
        critic = None
        if state["critic"] is not None:
            from .trainer import ValueModel
            with torch.device("meta"):
                critic = ValueModel(self._policy_module(None))
            critic.load_state_dict(_own_storage(state["critic"]), assign=True)
        return TrainerState(policy, StateDictHolder(state["optimizer"]), StateDictHolder(state["scheduler"]),
                            critic, StateDictHolder(state["critic_optimizer"]), state["algorithm"])

    def _policy_module(self, state: dict[str, Tensor] | None) -> nn.Module:
        """An HF model holding ``state`` (built on the meta device: no copy of the weights)."""
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained(self.model_path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        if state is not None:
            model.load_state_dict(_with_tied(_own_storage(state), model), assign=True)
            model.tie_weights()
        return model

    def load_checkpoint(self, c: Checkpoint) -> None:
        from safetensors.torch import load_file

        def weights(folder: Any) -> dict[str, Tensor] | None:
            if folder is None:
                return None
            state: dict[str, Tensor] = {}
            for f in sorted(folder.glob("*.safetensors")):
                state.update(load_file(str(f), device="cpu"))
            if not state:
                raise FileNotFoundError(f"no .safetensors files in {folder}")
            return state

        state = {"policy": weights(c.policy_path), "critic": weights(c.critic_path),
                 "optimizer": c.optimizer, "critic_optimizer": c.critic_optimizer,
                 "scheduler": c.scheduler, "algorithm": c.extra.get("algorithm", {})}
        self._all("load_state", self.cluster.ray.put(state), what=f"loading {c.path.name}")

    def close(self) -> None:
        self.cluster.close()


class RayRolloutGroup:
    """M :class:`RolloutWorker` actors behind the rollout-group interface (groups.py)."""

    def __init__(self, cluster: RayCluster, cfg: RunConfig, payload: dict[str, Any], pad_id: int):
        self.cluster, self.cfg, self.pad_id = cluster, cfg, pad_id
        m = max(1, cfg.distributed.rollout_workers)
        gpus = payload["rollout_gpus"]
        self.actors = [cluster.spawn(RolloutWorker, w, payload, num_cpus=cfg.threads, num_gpus=gpus)
                       for w in range(m)]
        self.names = [f"rollout worker {w}" for w in range(m)]

    def start(self) -> list[tuple[str, Any]]:
        return [(name, a.ready.remote()) for name, a in zip(self.names, self.actors)]

    def generate(self, prompts: list[str], answers: list[str], params: SamplingParams) -> Generation:
        from .loop import _concat, step_seed
        bounds = torch.arange(len(prompts)).tensor_split(len(self.actors))
        chunks = [(w, int(b[0]), int(b[-1]) + 1) for w, b in enumerate(bounds) if len(b)]
        calls = []
        for w, lo, hi in chunks:
            p = params
            if len(chunks) > 1 and params.seed is not None:
                p = dataclasses.replace(params, seed=step_seed(params.seed, w, 0, "chunk"))
            calls.append((self.names[w], self.actors[w].generate.remote(prompts[lo:hi], answers[lo:hi], p)))
        t0 = time.perf_counter()
        gens: list[Generation] = self.cluster.wait(calls, self.cfg.distributed.call_timeout, "the rollout")
        wall = time.perf_counter() - t0
        reward_s = max(g.reward_s for g in gens)
        return Generation(_concat([g.batch for g in gens], self.pad_id),
                          merge_rewards([g.scored for g in gens]), wall - reward_s, reward_s)

    def load_weights(self, weights: Any) -> None:
        """Every actor loads the trainers' full state dict (an ObjectRef) within ``sync_timeout``."""
        self.cluster.wait([(name, a.update_weights.remote(weights)) for name, a in zip(self.names, self.actors)],
                          self.cfg.distributed.sync_timeout, "the weight sync")

    def close(self) -> None:
        self.cluster.close()


def build_distributed(algo: rldsl.Algorithm, fn: rldsl.CompiledAlgorithm, cfg: RunConfig,
                      run_dir: Any) -> Any:
    """The :class:`~rldsl.runtime.loop.Setup` of a run on Ray: actors started, models loaded."""
    from .loop import RunError, Setup, _load_data, _load_tokenizer, _model_path, _reward_name
    d = cfg.distributed
    if cfg.rollout.engine == "vllm" and cfg.device != "cuda":
        raise RunError("rollout.engine=vllm needs GPUs: use --device cuda (or rollout.engine=hf)")
    path, _ = _model_path(cfg)  # the toy model is warm-started here, once
    tok = _load_tokenizer(path)
    source, held = _load_data(cfg)
    reward_name = _reward_name(cfg)
    reward = RewardFn(reward_name, on_error=cfg.reward.on_error)  # a bad name fails here, not in an actor
    actor_cfg = cfg.model_copy(deep=True)
    actor_cfg.model.path = os.path.abspath(str(path))
    gpus = d.gpus_per_worker if d.gpus_per_worker is not None else (1.0 if cfg.device == "cuda" else 0.0)
    payload = {"config": actor_cfg.model_dump_json(), "algorithm": algo, "compile": fn.compiled,
               "reward": reward_name,
               "rollout_gpus": gpus,
               "sys_path": [os.getcwd() if p == "" else os.path.abspath(p) for p in sys.path]}
    cluster = RayCluster(cfg, (d.trainers + max(1, d.rollout_workers)) * cfg.threads)
    try:
        trainers = RayTrainerGroup(cluster, cfg, payload, str(path))
        rollouts = RayRolloutGroup(cluster, cfg, payload, tok.pad_token_id)
        calls = rollouts.start() + trainers.start()
        cluster.wait(calls, d.call_timeout, "start-up")  # a stuck rendezvous fails by the collective timeout
    except BaseException:
        cluster.close()
        raise
    return Setup(cfg, algo, fn, run_dir, None, tok, None, None, source, held, reward,
                 rollouts=rollouts, trainers=trainers)
