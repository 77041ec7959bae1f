"""The LoRA adapters alone as a weight sync sends them (``model.lora.sync = "adapter"``): a few
MB instead of the model; the engine holds them as its adapter of the policy's version (the hf
engine in its own LoRA layers, vLLM as a ``LoRARequest``). The base weights never move."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from torch import Tensor, nn

from ...models.lora import LoraAdapter, adapter_of
from ...rollout.engines.base import RolloutEngine
from .buckets import as_adapter


@dataclass
class Adapter:
    """One :class:`~rldsl.runtime.models.lora.LoraAdapter`: CPU copies already, so a snapshot itself."""

    adapter: LoraAdapter

    @property
    def nbytes(self) -> int:
        return self.adapter.nbytes

    def snapshot(self) -> "Adapter":
        return self

    def load_into(self, engine: RolloutEngine, version: int) -> None:
        engine.load_adapter(self.adapter, version)


@dataclass(frozen=True)
class AdapterKind:
    """Sends the adapters alone; ``rank`` and ``alpha``: the config's (``model.lora``), which the
    collective sync's receiving side needs to rebuild them."""

    rank: int
    alpha: float
    adapters = True

    def send(self, policy: nn.Module) -> Adapter:
        return Adapter(adapter_of(policy))

    def gather(self, trainer: Any) -> Adapter | None:
        adapter = trainer.full_adapter()  # ShardedTrainer: gathered to rank 0's CPU
        return None if adapter is None else Adapter(adapter)

    def received(self, named: Iterable[tuple[str, Tensor]], nbytes: int) -> Adapter:
        return Adapter(as_adapter(named, self.rank, self.alpha))
