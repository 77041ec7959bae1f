"""One trainer rank started: it joins the ``torch.distributed`` group, seeds, compiles the
algorithm and loads the policy (``recipe.py``), sharded with FSDP2 (fsdp.py) -- this rank's
:class:`~rldsl.runtime.workers.fsdp.ShardedTrainer`.

Nothing here knows Ray: :func:`start_rank` needs only a rendezvous address (a Ray trainer
actor, trainer_actor.py, calls it).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn

import rldsl

from ..config import RunConfig
from ..recipe import master_policy, trainable
from ..records.rng import seed_all
from .fsdp import ShardedTrainer, attach_logprobs, shard_module


def start_rank(cfg: RunConfig, algo: rldsl.Algorithm, compile: bool, *, rank: int, world: int,
               device: torch.device, host: str, port: int, listen_fd: int | None = None) -> ShardedTrainer:
    """Join the process group at ``host:port``, load the policy and shard it: this rank's trainer.

    ``listen_fd`` (rank 0): a socket already bound to ``host:port`` and listening, on which the
    group's store serves; without it torch's store listens on every interface of the machine.
    ``cfg.model.path`` must be a model folder (the driver warm-starts the toy model first).
    """
    from torch.distributed.device_mesh import init_device_mesh
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=cfg.distributed.collective_timeout)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout,
                          master_listen_fd=listen_fd if rank == 0 else None)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    mesh = init_device_mesh(device.type, (world,))
    seed_all(cfg.seed)
    fn = rldsl.compile(algo, compile=compile)
    policy, reference_off = trainable(  # adapters train, the base is frozen; FSDP2 shards both kinds
        cfg, master_policy(cfg, cfg.model.path, device),
        checkpointing=cfg.distributed.activation_checkpointing or cfg.train.gradient_checkpointing)
    mixed = param_dtype(cfg, device)

    def prepare(policy: nn.Module, reference: nn.Module | None, critic: nn.Module | None) -> None:
        for module, logprobs in ((policy, True), (reference, True), (critic, False)):
            if module is not None:
                shard_module(module, mesh, mixed_precision=mixed, gloo=backend == "gloo")
                if logprobs:
                    attach_logprobs(module)

    return ShardedTrainer.from_config(cfg, fn, policy, prepare=prepare, reference_off=reference_off,
                                      rank=rank, world=world, device=device)


def param_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype | None:
    """The dtype FSDP2 computes the unsharded parameters in (``distributed.mixed_precision``),
    None for none. 'auto': ``model.dtype``'s 16-bit type, the one the rollout engine runs (a
    float16 run computes in float16, not bf16: one precision end to end), else bf16 on cuda."""
    mp = cfg.distributed.mixed_precision
    if mp == "off":
        return None
    if mp == "bf16":
        return torch.bfloat16
    sixteen = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.model.dtype)
    return sixteen if sixteen is not None else (torch.bfloat16 if device.type == "cuda" else None)
