"""The full state as a weight sync sends it: every tensor of the policy under the plain model's
names, LoRA adapters merged into their base weights (so no LoRA tensor reaches an engine),
loaded into the engine in place. The default kind (``model.lora.sync = "merged"``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from torch import Tensor, nn

from ...models.lora import merged_weights
from ...rollout.engines.base import RolloutEngine


@dataclass
class FullState:
    """Named tensors for the engine's ``update_weights``. In one process they are views of the
    trainer's live parameters (a merged LoRA tensor is a new one): :meth:`snapshot` copies them."""

    tensors: dict[str, Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def snapshot(self) -> "FullState":
        return FullState({name: t.detach().clone() for name, t in self.tensors.items()})

    def load_into(self, engine: RolloutEngine, version: int) -> None:
        engine.update_weights(self.tensors.items())


@dataclass
class StreamedState:
    """The full state as the collective sync's buckets deliver it: each tensor a view of its
    bucket's buffer, handed to the engine as it arrives (peak memory: a bucket, never the model)."""

    named: Iterator[tuple[str, Tensor]]
    nbytes: int

    def snapshot(self) -> FullState:
        """The rest of the stream, copied (it is read once)."""
        return FullState({name: t.detach().clone() for name, t in self.named})

    def load_into(self, engine: RolloutEngine, version: int) -> None:
        engine.update_weights(self.named)


class FullStateKind:
    """Sends the full state, LoRA merged (``model.lora.sync = "merged"``, and every run without LoRA)."""

    adapters = False

    def send(self, policy: nn.Module) -> FullState:
        return FullState({name: t.detach() for name, t in merged_weights(policy).items()})

    def gather(self, trainer: Any) -> FullState | None:
        state = trainer.full_weights()  # ShardedTrainer: merged, on rank 0's CPU
        return None if state is None else FullState(state)

    def received(self, named: Iterable[tuple[str, Tensor]], nbytes: int) -> StreamedState:
        return StreamedState(iter(named), nbytes)
