"""What a model kind is: the part of a forward that depends on the model's family.

A kind (text, the Qwen2-VL family, ...) owns what a family adds to a forward over token rows:
its positions (Qwen2-VL's M-RoPE), the inputs beside the ids (a vision-language policy's pixel
values, image grids and token types) and how its image placeholders stand in the ids. The
trainer asks the run's kind once per forward for a :class:`ForwardInputs` and passes it on:
the padded and packed layouts of train/logprobs.py feed the backbone what the record gives,
whatever the family. The kind is chosen once from the model's config.json (models/kinds/choose.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ContextManager, Iterable, Protocol, Sequence

if TYPE_CHECKING:
    import torch
    from torch import nn


class ForwardInputs(Protocol):
    """A family's inputs of one forward over B rows (prompt left padded, response right padded,
    [B, T]) beside their ids and attention mask.

    whole_rows  the rows' positions or inputs are each row's own (images, M-RoPE): a row runs
                whole, never sharing its prompt's states with its group's other rows; packed,
                each packed row is made of whole sequences (:meth:`packed`)
    """

    whole_rows: bool

    def padded(self, body: nn.Module, columns: int) -> tuple[dict[str, Any], ContextManager]:
        """The backbone's keyword arguments beside ``input_ids`` and ``attention_mask`` for the
        first ``columns`` columns of the padded rows (``position_ids`` and the family's own), and
        the context the forward of ``body`` runs in."""

    def packed(self, body: nn.Module, rows: Sequence[int], starts: Sequence[int],
               lengths: Sequence[int]) -> tuple[dict[str, Any], ContextManager]:
        """Asked only when :attr:`whole_rows` (a text model's rows pack as train/packing.py
        lays them out): the keyword arguments of one packed row (``input_ids`` and
        ``position_ids`` included), rows ``rows``' real tokens (``lengths[b]`` from column
        ``starts[b]``) end to end, each with its own positions and inputs; and the context the
        forward of ``body`` runs in."""

    def to(self, device: torch.device) -> "ForwardInputs":
        """The record with its tensors on ``device``."""


class ModelKind(Protocol):
    """A model family: what its forwards need beside the token ids (train/), and how its prompts'
    images become tokens (the rollout side).

    name      the kind's name (``text``, ``qwen2_vl``), shown in messages
    """

    name: str

    def check_run(self, algo: Any, cfg: Any) -> None:
        """Before any model loads (config.json and the folder's files only): a ConfigError or
        RunError for a run (``algo``, the ``RunConfig``) whose forwards this kind's inputs would
        not reach."""

    def processed(self, refs: Sequence[Sequence[str]]) -> list[Any]:
        """Each row's images (``RolloutBatch.images``) processed once on the rollout side, what the
        batch carries to the trainer (``RolloutBatch.image_inputs``); a text model's: none, []."""

    def check_prompts(self, what: str, image_rows: Sequence[int], total: int) -> None:
        """ValueError naming ``what`` (the data) when this kind cannot read prompts with images and
        ``image_rows`` (0-based ids of ``total`` rows) hold some."""

    def forward_inputs(self, model: nn.Module, rows: Any, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor) -> ForwardInputs:
        """The inputs of a forward of ``model`` over ``rows`` (a ``RolloutBatch``: its images, which
        of its response tokens were sampled) whose ids and mask are ``input_ids`` /
        ``attention_mask`` [B, T] (prompts then responses)."""

    def message_images(self, messages: Sequence[dict]) -> list[str]:
        """The image refs of chat ``messages`` in order, the ones this kind reads (a text model's:
        none)."""

    def prompt(self, text: str, refs: Sequence[str]) -> str:
        """A rendered prompt carrying the images ``refs`` (``models.vision.VisionPrompt``: what
        the engine encodes and samples.jsonl records); a text model's: ``text``."""

    def image_prompts(self, texts: Iterable[str], refs: Sequence[Sequence[str]]) -> list[str] | None:
        """Prompts ``texts`` carrying their rows' images ``refs`` for an engine's ``generate_ids``;
        None when no row holds an image (the engine decodes the ids; ``texts``, which may be a
        generator, is then not read)."""

    def image_part(self, url: str) -> dict:
        """The chat template's content part of an image at ``url`` (a checked data: URL);
        ValueError for a kind that takes no images."""

    def prompt_ids(self, text: str, refs: Sequence[str]) -> list[int]:
        """The token ids of ``text`` (a rendered chat, or a turn's delta) holding the images
        ``refs`` in order (their placeholders expanded); ValueError when they do not match."""

    def check_plain_ids(self, ids: Sequence[int]) -> None:
        """ValueError when ``ids`` hold an image token (a token or text prompt takes no images)."""
