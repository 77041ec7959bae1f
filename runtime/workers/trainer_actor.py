"""A trainer rank on a Ray actor: ``TrainerWorker`` starts one rank of the FSDP2 group
(fsdp_rank.py: gloo on CPU, nccl on GPU) and runs its calls; ``RayTrainers`` (ray_trainers.py)
drives N of them. The group's store serves on the socket rank 0 bound on 127.0.0.1, or on its
node's address when the ranks span nodes, never on every interface.
"""
from __future__ import annotations

import socket
from typing import Any

import torch
from torch import Tensor

from ..batch import RolloutBatch
from ..train.trainer import TrainBatch
from .fsdp import ShardedTrainer
from .fsdp_rank import start_rank
from .ray_cluster import actor_config
from .sync.base import EngineWeights, kind_of
from .sync.buckets import SyncGroup, as_plain, send_buckets, sync_plan


class TrainerWorker:
    """One trainer rank (a Ray actor): FSDP2-sharded policy, reference, critic and optimizers."""

    def __init__(self, rank: int, world: int, payload: dict[str, Any]):
        self.cfg = actor_config(payload)
        self.rank, self.world, self.payload = rank, world, payload
        if self.cfg.device == "cuda":
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")
        self.trainer: ShardedTrainer | None = None
        self.sync = kind_of(self.cfg)  # what a weight sync sends: the full state, or the LoRA adapters alone
        self.pending: TrainBatch | None = None
        self.listener: socket.socket | None = None  # rank 0: where the group's store serves
        self.sync_listener: socket.socket | None = None  # rank 0: where the weight-sync group's store serves
        self.sync_group: SyncGroup | None = None  # rank 0, distributed.weight_sync = "collective"
        self.plan: list | None = None

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

    def advantages(self) -> Tensor:
        """The estimated batch's advantages [B, Tr] on the CPU (every rank holds rank 0's:
        fsdp.py broadcasts them): what ``replay(advantage=keep)`` keeps on the driver."""
        assert self.pending is not None, "advantages() before estimate()"
        return self.pending.advantages.cpu()

    def update(self, seed: int) -> dict[str, Any]:
        t = self.trainer
        assert t is not None and self.pending is not None, "update() before estimate()"
        m = t.update(self.pending, torch.Generator().manual_seed(seed))
        t.step_schedule()
        self.pending = None
        return {"metrics": m, "lr": float(t.optimizer.param_groups[0]["lr"])}

    def full_weights(self) -> tuple[int | None, EngineWeights | None]:
        """(their bytes, the weights the run's sync kind sends: the full state dict, or with
        ``model.lora.sync = "adapter"`` the LoRA adapters alone) on rank 0, (None, None) elsewhere:
        a collective over the ranks."""
        assert self.trainer is not None
        weights = self.sync.gather(self.trainer)
        return (None if weights is None else weights.nbytes), weights

    # -- the collective weight sync (sync/buckets.py; sync/collective.py drives it)

    def sync_plan(self, max_bytes: int) -> list:
        """The bucket plan (every rank computes the same); rank 0's answer goes to the rollout workers."""
        assert self.trainer is not None
        self.plan = sync_plan(self.trainer.policy, max_bytes, adapters=self.sync.adapters)
        return as_plain(self.plan)

    def sync_listen(self, local: bool) -> tuple[str, int]:
        """Rank 0: a socket for the weight-sync group's store, bound on 127.0.0.1 (or this node's
        address when ``local`` is false) and held until the store serves on it."""
        import ray
        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        self.sync_listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        return host, int(self.sync_listener.getsockname()[1])

    def sync_join(self, host: str, port: int, world: int, generation: int) -> int:
        """Rank 0: (re)join the weight-sync group as its rank 0 (the previous one is dropped)."""
        assert self.sync_listener is not None
        # the store owns the socket from now on: detached, so that Python never closes its fd
        # (once this group is dropped, that fd number may be the next group's socket)
        fd, self.sync_listener = self.sync_listener.detach(), None
        if self.sync_group is not None:
            self.sync_group.close()
        self.sync_group = SyncGroup(host, port, 0, world, self.cfg.distributed.sync_timeout, self.device,
                                    generation, f"trainer rank {self.rank}", listen_fd=fd)
        return generation

    def sync_send(self, generation: int) -> tuple[int, str | None]:
        """Every rank: gather the buckets; rank 0 broadcasts them. (bytes sent, None)."""
        assert self.trainer is not None and self.plan is not None
        group = self.sync_group if self.rank == 0 else None
        return send_buckets(self.trainer.policy, self.plan, group, self.device, generation)

    def checkpoint_state(self) -> dict[str, Any] | None:
        """Full (unsharded) model and optimizer states, on rank 0: a collective over the ranks."""
        assert self.trainer is not None
        return self.trainer.full_state()

    def load_state(self, state: dict[str, Any]) -> None:
        """Load full states (a checkpoint of any number of ranks) into this rank's shards."""
        assert self.trainer is not None
        self.trainer.load_full_state(state)
