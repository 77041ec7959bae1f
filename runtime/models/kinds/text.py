"""The text kind: a causal LM whose forwards need only the ids and their positions."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ContextManager, Iterable, Sequence

from rldsl.lazy_torch import torch

if TYPE_CHECKING:
    from torch import nn


def mask_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions counting only real tokens: ``cumsum(mask) - 1`` clamped at 0, what
    ``generate`` uses for left-padded prompts (batch.py ``position_ids_from_mask``)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


@dataclass(frozen=True)
class TextInputs:
    """A text forward's inputs beside the ids: positions from the attention mask [B, T]."""

    position_ids: torch.Tensor
    whole_rows: bool = False

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> "TextInputs":
        return cls(mask_positions(attention_mask))

    def padded(self, body: nn.Module, columns: int) -> tuple[dict[str, Any], ContextManager]:
        return {"position_ids": self.position_ids[..., :columns]}, contextlib.nullcontext()

    def to(self, device: torch.device) -> "TextInputs":
        return replace(self, position_ids=self.position_ids.to(device))


class TextKind:
    """A text model (``AutoModelForCausalLM``): ids and mask-derived positions, no images."""

    name = "text"

    def __init__(self, folder: str = "", tokenizer: Any = None):
        self.tokenizer = tokenizer

    @staticmethod
    def claims(config: dict) -> bool:
        """Every config without a vision tower (``vision_config``)."""
        return "vision_config" not in config

    def check_run(self, algo: Any, cfg: Any) -> None:
        """A text model's forwards need nothing beside the ids."""

    def processed(self, refs: Sequence[Sequence[str]]) -> list[Any]:
        return []

    def check_prompts(self, what: str, image_rows: Sequence[int], total: int) -> None:
        if image_rows:
            raise ValueError(f"{what}: {len(image_rows)} of {total} prompts hold images (the first: row "
                             f"{image_rows[0] + 1})")

    def forward_inputs(self, model: nn.Module, rows: Any, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor) -> TextInputs:
        return TextInputs.of(attention_mask)

    def message_images(self, messages: Sequence[dict]) -> list[str]:
        return []

    def prompt(self, text: str, refs: Sequence[str]) -> str:
        return text

    def image_prompts(self, texts: Iterable[str], refs: Sequence[Sequence[str]]) -> list[str] | None:
        return None

    def image_part(self, url: str) -> dict:
        raise ValueError("the served model is a text model: it takes no image_url parts")

    def prompt_ids(self, text: str, refs: Sequence[str]) -> list[int]:
        if refs:
            raise ValueError(f"{len(refs)} images for a text model")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def check_plain_ids(self, ids: Sequence[int]) -> None:
        """A text model's ids stand for no image."""
