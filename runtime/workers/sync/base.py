"""The weight sync's interface: what the trainers send and the engines receive.

A run syncs one way, chosen once at start-up from its config (:func:`kind_of`; on Ray the transport
too: transports.py), and every value says itself how it is received, so no receiver asks a value
what it is:

- the weights an engine loads (:class:`EngineWeights`): the full state, LoRA merged
  (full_state.py), or the LoRA adapters alone (adapter.py, ``model.lora.sync = "adapter"``); a
  :class:`Kind` makes them on the trainers' side, from one process's policy or from the FSDP2
  ranks' shards. In one process (local_trainers.py -> local.py) they go straight to the engine.
- on Ray, a :class:`Transport` carries them from the trainer ranks to the rollout actors: Ray's
  object store (object_store.py: rank 0's gathered weights) or a broadcast in buckets over a
  process group of its own (collective.py, buckets.py: ``distributed.weight_sync = "collective"``).
"""
from __future__ import annotations

from typing import Any, Iterable, Protocol

from torch import Tensor, nn

from ...config import RunConfig
from ...rollout.engines.base import RolloutEngine
from .adapter import AdapterKind
from .full_state import FullStateKind


class Weights(Protocol):
    """What ``Trainers.weights()`` returns and ``Rollouts.load_weights()`` takes."""

    def snapshot(self) -> "Weights":
        """These weights, unchanged by later updates (what an asynchronous run publishes)."""
        ...


class EngineWeights(Weights, Protocol):
    """Weights an engine in this process loads: the receiving side of one sync kind."""

    @property
    def nbytes(self) -> int:
        """The bytes sent to each engine (``sync/bytes``)."""
        ...

    def load_into(self, engine: RolloutEngine, version: int) -> None:
        """Load into ``engine``, as policy ``version`` (the optimizer steps the weights have had)."""
        ...


class Kind(Protocol):
    """The sending side of one kind of :class:`EngineWeights`, for the trainer in this process
    and for the FSDP2 ranks (their collective sync's buckets too)."""

    #: the collective sync's buckets hold the LoRA adapters alone, nothing merged
    adapters: bool

    def send(self, policy: nn.Module) -> EngineWeights:
        """The weights of the one-process trainer's ``policy``."""
        ...

    def gather(self, trainer: Any) -> EngineWeights | None:
        """The weights of the FSDP2 ranks (``trainer``: this rank's ``ShardedTrainer``), gathered to
        rank 0 (None on the others): every rank joins."""
        ...

    def received(self, named: Iterable[tuple[str, Tensor]], nbytes: int) -> EngineWeights:
        """The tensors (``nbytes`` in all) a rollout worker receives from the collective sync's
        buckets, as this kind."""
        ...


def kind_of(cfg: RunConfig) -> Kind:
    """The LoRA adapters alone with ``model.lora.sync = "adapter"`` (and LoRA on), else the full
    state, LoRA merged."""
    lo = cfg.model.lora
    if lo.rank and lo.sync == "adapter":
        return AdapterKind(lo.rank, lo.alpha)
    return FullStateKind()


class Transport(Protocol):
    """How the trainer ranks' weights reach the rollout actors on Ray (ray_trainers.py sends,
    ray_rollouts.py receives; both are given the same transport when they are made)."""

    #: the bytes the last sync sent to each rollout worker (``sync/bytes``)
    bytes: int

    def send(self, trainers: Any) -> Weights:
        """The trainers' side (a ``RayTrainers``): the current weights, or a handle when the sync
        moves them only once the rollouts receive."""
        ...

    def receive(self, rollouts: Any, weights: Weights, version: int, policy_version: int) -> None:
        """Every rollout actor of ``rollouts`` (a ``RayRollouts``) loads ``weights``: the driver's
        sync ``version``, policy ``policy_version``."""
        ...

    def restore(self, rollouts: Any, w: int, weights: Weights, version: int, policy_version: int) -> None:
        """Rollout actor ``w``, restarted by Ray, loads again the weights the others hold."""
        ...
