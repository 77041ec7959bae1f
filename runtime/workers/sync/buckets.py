"""The collective weight sync (``distributed.weight_sync = "collective"``), without Ray: a process
group made for the sync alone (:class:`SyncGroup`: trainer rank 0 is its rank 0, rollout worker w
its rank w + 1; gloo on CPU, NCCL on GPU, over its own TCP store), the bucket plan every side
agrees on (:func:`sync_plan`), the trainer side (:func:`send_buckets`: every trainer rank gathers
the FSDP2 shards of one bucket at a time, rank 0 merges LoRA adapters and broadcasts the bucket)
and the rollout side (:func:`receive_buckets`: the received tensors, one bucket at a time, for
the engine's in-place ``update_weights``). Peak host memory is a bucket (or the largest tensor,
when it is larger), never the model.

Every broadcast has the group's timeout (``distributed.sync_timeout``) and fails naming its side
and bucket. collective.py drives it from the Ray driver.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...errors import WeightSyncError
from ...models.lora import ADAPTER, LoraAdapter, lora_scalings, merge_state

_ALIGN = 16  # bytes: every tensor of a packed bucket starts on a multiple of this


@dataclass(frozen=True)
class Entry:
    """One tensor the sync sends: its name in the plain model (what the engine loads), shape,
    dtype, and the trainer's state-dict keys it is made of (a LoRA module: base, A, B)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    sources: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=_dtype(self.dtype)).element_size()


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def bucket_bytes(bucket: list[Entry]) -> int:
    return sum(_padded(e.nbytes) for e in bucket)


def bucket_label(i: int, plan: list[list[Entry]]) -> str:
    b = plan[i]
    return f"bucket {i + 1} of {len(plan)} ({b[0].name} .. {b[-1].name}, {bucket_bytes(b) / 2**20:.3g} MiB)"


def sharded_state(policy: nn.Module) -> dict[str, Tensor]:
    """The policy's state dict as FSDP2 holds it (DTensor shards), under the plain module names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(policy, options=StateDictOptions(full_state_dict=False))


def sync_plan(policy: nn.Module, max_bytes: int, adapters: bool = False) -> list[list[Entry]]:
    """The tensors the engines load (LoRA adapters merged into their base weights, so no LoRA
    name), in buckets of at most ``max_bytes`` (a larger tensor is a bucket of its own). The
    same on every trainer rank: the state dict's order. ``adapters`` (``model.lora.sync =
    "adapter"``): the LoRA adapter tensors alone, under the trainer's names, nothing merged."""
    state = sharded_state(policy)
    scalings = lora_scalings(policy)
    entries = []
    for key, value in state.items():
        if adapters:
            if ".lora_" in key:
                entries.append(Entry(key, tuple(value.shape), str(value.dtype), (key,)))
            continue
        if ".lora_" in key:
            continue
        name = key.replace(".base_layer.", ".")
        module = name.rsplit(".", 1)[0]
        sources = (key,)
        if name.endswith(".weight") and module in scalings:
            sources += (f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight")
        entries.append(Entry(name, tuple(value.shape), str(value.dtype), sources))
    plan: list[list[Entry]] = []
    for e in entries:
        if plan and bucket_bytes(plan[-1]) + _padded(e.nbytes) <= max_bytes:
            plan[-1].append(e)
        else:
            plan.append([e])
    return plan


class SyncGroup:
    """A process group for the sync alone, beside any other (the trainers' FSDP2 group): its own
    TCP store (served by rank 0, on ``listen_fd`` when given: a socket bound to ``host:port``) and
    a gloo (CPU) or NCCL (CUDA) backend whose every collective waits at most ``timeout`` s."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout: float, device: torch.device,
                 generation: int, side: str, listen_fd: int | None = None):
        self.rank, self.world, self.device, self.side = rank, world, device, side
        self.timeout = datetime.timedelta(seconds=timeout)
        self.generation = generation
        store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=self.timeout,
                              master_listen_fd=listen_fd if rank == 0 else None)
        self.store = store
        prefixed = dist.PrefixStore(f"rldsl-weight-sync/{generation}", store)
        if device.type == "cuda":  # written for a GPU, not measured on one yet (docs/scaling.md)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world, self.timeout)
        self._barrier("joining the group")

    def _barrier(self, what: str) -> None:
        """One small broadcast: every member is up (a missing one fails within the timeout)."""
        self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device), what)

    def broadcast(self, buf: Tensor, what: str) -> None:
        """Broadcast ``buf`` from rank 0 (the trainer), in place; raises naming side and ``what``."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.timeout
        try:
            self.pg.broadcast([buf], opts).wait()
            if buf.is_cuda:
                torch.cuda.current_stream().synchronize()
        except Exception as e:  # noqa: BLE001 - gloo/nccl raise RuntimeError (or DistBackendError)
            raise WeightSyncError(f"{self.side}: the weight sync failed at {what} (group of {self.world}, "
                                  f"distributed.sync_timeout={self.timeout.total_seconds():g} s): "
                                  f"{type(e).__name__}: {str(e).strip()[:300]}") from None

    def close(self) -> None:
        for name in ("pg", "store"):
            setattr(self, name, None)


def _pack(tensors: list[Tensor], total: int, device: torch.device) -> Tensor:
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    offset = 0
    for t in tensors:
        raw = t.detach().contiguous().view(-1).view(torch.uint8)
        buf[offset:offset + raw.numel()].copy_(raw)
        offset += _padded(raw.numel())
    return buf


def _full(t: Tensor) -> Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def send_buckets(policy: nn.Module, plan: list[list[Entry]], group: SyncGroup | None,
                 device: torch.device, generation: int | None = None) -> tuple[int, str | None]:
    """The trainer side: every trainer rank gathers each bucket's shards (FSDP2 all-gathers, in the
    plan's order); rank 0 (the one with a ``group``) merges LoRA modules and broadcasts the bucket.
    A failed broadcast does not stop the gathers (the other ranks are still in them): the ranks
    stay in step, and rank 0 raises the broadcast's error once they are done. ``generation``: the
    group the driver formed last, which rank 0's ``group`` must be. (bytes sent, None)."""
    if group is not None and generation is not None and group.generation != generation:
        raise WeightSyncError(f"{group.side} holds weight-sync group {group.generation}, not {generation}")
    state = sharded_state(policy)
    scalings = lora_scalings(policy) if group is not None else {}
    sent, error = 0, None
    for i, bucket in enumerate(plan):
        tensors = []
        for e in bucket:
            parts = {k: _full(state[k]) for k in e.sources}
            if group is None:
                continue
            module = e.name.rsplit(".", 1)[0]
            if len(e.sources) > 1:
                merged = merge_state(parts, {module: scalings[module]})
            else:
                merged = {e.name: parts[e.sources[0]]}
            tensors.append(merged[e.name].to(device))
        if group is None or error is not None:
            continue
        buf = _pack(tensors, bucket_bytes(bucket), device)
        del tensors
        try:
            group.broadcast(buf, bucket_label(i, plan))
            sent += sum(e.nbytes for e in bucket)
        except WeightSyncError as err:
            error = str(err)
    if error is not None:  # raised once every rank is through its gathers
        raise WeightSyncError(error)
    return sent, error


def receive_buckets(group: SyncGroup, plan: list[list[Entry]]) -> Iterator[tuple[str, Tensor]]:
    """The rollout side: (name, tensor) of each bucket as it arrives, views of the bucket's buffer
    (on the group's device), for the engine's ``update_weights``."""
    for i, bucket in enumerate(plan):
        buf = torch.empty(bucket_bytes(bucket), dtype=torch.uint8, device=group.device)
        group.broadcast(buf, bucket_label(i, plan))
        offset = 0
        for e in bucket:
            n = e.nbytes
            yield e.name, buf[offset:offset + n].view(_dtype(e.dtype)).view(e.shape)
            offset += _padded(n)


def as_adapter(named: Iterable[tuple[str, Tensor]], rank: int, alpha: float) -> LoraAdapter:
    """Received adapter tensors (views of a bucket's buffer: copied out) as one adapter, for the
    engine's ``load_adapter`` (``model.lora.sync = "adapter"`` over the collective path: adapter.py)."""
    return LoraAdapter({name: t.detach().to("cpu", copy=True) for name, t in named}, rank, alpha)


def plan_bytes(plan: list[list[Entry]]) -> int:
    return sum(bucket_bytes(b) for b in plan)


def as_plain(plan: list[list[Entry]]) -> list[list[tuple[str, tuple[int, ...], str]]]:
    """What a rollout worker needs of the plan (names, shapes, dtypes)."""
    return [[(e.name, e.shape, e.dtype) for e in b] for b in plan]


def from_plain(plain: Any) -> list[list[Entry]]:
    return [[Entry(n, tuple(s), d, ()) for n, s, d in b] for b in plain]
