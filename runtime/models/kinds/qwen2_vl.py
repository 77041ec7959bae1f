"""The Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a vision-language policy's forwards --
each row with its images' pixel values, grids and token types, M-RoPE positions per row, padded
or packed -- and how its prompts' images become tokens.

A Qwen2-VL-family model places image tokens on a (temporal, height, width) grid: its position
ids are (3, B, T), and the text after an image resumes at the image's offset + max(h, w) / merge,
not at its token count. A forward must therefore get ``pixel_values``, ``image_grid_thw`` and
``mm_token_type_ids`` (without the token types transformers refuses, or -- older releases --
silently positions the images as text), and positions computed per sequence.

Padded (:meth:`ImageInputs.padded`): rows right-padded, positions from the model's
``get_rope_index`` with the attention mask. Packed (:meth:`ImageInputs.packed`): the sequences
end to end in one row, each sequence's own positions under a leading row of per-sequence text
positions (0, 1, ... restarting at every sequence: shape (4, 1, S)), from which transformers
builds the block-diagonal causal mask; pixel values, grids and token types concatenated in row
order. Letting the model compute positions on a packed row is wrong (the second sequence's
positions would continue the first's). Both give the same logprobs as ``generate``
(tests/runtime/models/test_vlm.py). :class:`VisionSequence` and :func:`sequence_logprobs` are the
same forwards over single sequences (the tests' reference).

Shapes: N sequences of n_i tokens (prompt p_i + response r_i), P_i patches of D = C * temporal
* patch^2 values each, g_i images.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager, Iterable, Iterator, Sequence

from rldsl.lazy_torch import torch

from ...errors import ConfigError, RunError

from ..vision import IMAGE_TOKEN, VisionProcessor, load_processor
from .text import TextInputs

if TYPE_CHECKING:
    from torch import Tensor, nn

#: the config.json ``model_type`` of each family this kind reads
MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


class Qwen2VLKind:
    """A Qwen2-VL-family policy. Its processor (the folder's image processor and tokenizer,
    models/vision.py) is this kind's, read from the folder the kind was chosen from the first
    time an image is processed; each image is processed once (by its ref) and kept."""

    name = "qwen2_vl"

    def __init__(self, folder: str, tokenizer: Any = None):
        self.folder = folder
        self.tokenizer = tokenizer
        self._processor: VisionProcessor | None = None

    @staticmethod
    def claims(config: dict) -> bool:
        """A config of the family's with its vision tower (``vision_config``: models/loading.py
        ``is_vision_folder``)."""
        return "vision_config" in config and config.get("model_type") in MODEL_TYPES

    @property
    def processor(self) -> VisionProcessor:
        if self._processor is None:
            self._processor = load_processor(self.folder, self.tokenizer)
        return self._processor

    def check_run(self, algo: Any, cfg: Any) -> None:
        """A Qwen2-VL-family policy runs where its images reach every forward (docs/vlm.md, "Engines
        and trainers"): the HF or vLLM engine, one process or FSDP2 trainer ranks and Ray rollout
        workers (the prompts carry their image refs), single-turn rollouts, multi-turn episodes and
        agents on the HF engine, a spec without a critic or a teacher, LoRA merged into vLLM's
        weights; its folder holds the image processor's preprocessor_config.json (read when the
        model is built: refused now, not after the load). Anything else is refused before any model
        loads, rather than silently training without the pictures."""
        if not (Path(self.folder) / "preprocessor_config.json").is_file():  # models/vision.py reads it
            raise RunError(f"{self.folder} is a vision-language model without preprocessor_config.json: save its "
                           "image processor beside the tokenizer (docs/vlm.md)")
        r = cfg.rollout
        refused = [what for what, on in (
            ("rollout.tools / rollout.env / rollout.agent on the vLLM engine (its token-in/token-out turns "
             "take no images yet; rollout.engine='hf' does)",
             r.engine == "vllm" and (r.tools is not None or r.env is not None or r.agent is not None)),
            ("rollout.partial=true", r.partial),
            (f"{algo.name}'s critic (a value model)", algo.uses_critic),
            (f"{algo.name}'s teacher", algo.uses_teacher),
        ) if on]
        if refused:
            raise ConfigError(f"{self.folder} is a vision-language model; its images do not reach the forwards of: "
                              f"{'; '.join(refused)}. Leave them out of a vision-language run "
                              "(docs/vlm.md, \"Engines and trainers\")")
        if cfg.model.lora.sync == "adapter" and r.engine == "vllm":
            raise ConfigError(f"{self.folder} is a vision-language model: model.lora.sync='adapter' on the vLLM "
                              "engine is tested on text models only; use model.lora.sync='merged'")

    def check_prompts(self, what: str, image_rows: Sequence[int], total: int) -> None:
        """A Qwen2-VL-family policy reads every prompt's images."""

    def processed(self, refs: Sequence[Sequence[str]]) -> list[dict[str, Tensor] | None]:
        """Each row's images (``refs``: ``RolloutBatch.images``, empty: none) processed once, on the
        rollout side: ``pixel_values`` [P, D] and ``image_grid_thw`` [g, 3] (None: a row without
        images), what the batch carries to the trainer (``RolloutBatch.image_inputs``)."""
        return [self.processor.image_inputs(r) if r else None for r in refs]

    def forward_inputs(self, model: nn.Module, rows: Any, input_ids: Tensor,
                       attention_mask: Tensor) -> ImageInputs | TextInputs:
        """The rows' images as the rollout side processed them (``rows.image_inputs``; a batch
        without them, from an older checkpoint: processed here). An episode's response also holds
        the environment's messages (attended, not sampled), whose image tokens are images:
        ``rows.response_mask`` tells which tokens were sampled."""
        sampled = None if rows.response_attention is None else rows.response_mask
        carried = rows.image_inputs or self.processed(rows.images)
        return self.image_inputs(model, carried, input_ids, attention_mask, rows.response_ids.shape[1], sampled)

    def image_inputs(self, model: nn.Module, images: Sequence[dict[str, Tensor] | None],
                     input_ids: Tensor, attention_mask: Tensor, response_tokens: int = 0,
                     sampled: Tensor | None = None) -> ImageInputs | TextInputs:
        """The inputs of a forward over B rollout rows (prompt left padded, response right padded:
        [B, T], the last ``response_tokens`` columns the responses) whose ids hold images
        (``images``: each row's, as :meth:`processed` made them): pixel values and
        grids in row order, ``mm_token_type_ids`` [B, T], M-RoPE ``position_ids`` [3, B, T] over each
        row's real tokens. Text inputs (positions from the mask) when no row has an image.

        Only the prompts' image placeholders are image tokens: a response may hold the placeholder
        id too (a policy can sample any token), which the engine fed back as a text token -- its
        own embedding at the next text position -- and so does the forward (:func:`typed_image_tokens`).
        ``sampled`` [B, response_tokens]: 1 where the policy sampled the response token; None: all."""
        rows = [r for r in images if r]
        if not rows:
            return TextInputs.of(attention_mask)
        device = input_ids.device
        types = (input_ids == model.config.image_token_id).long()
        if response_tokens:  # a sampled placeholder is text
            tail = types[:, input_ids.shape[1] - response_tokens:]
            tail.mul_(0 if sampled is None else (sampled == 0).long())
        grid = torch.cat([r["image_grid_thw"] for r in rows]).to(device)
        positions, _ = _rope(model).get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grid,
                                                   attention_mask=attention_mask)
        pixels = torch.cat([r["pixel_values"] for r in rows]).to(device)
        return ImageInputs(input_ids, attention_mask, positions, types, pixels, grid,
                           model.config.vision_config.spatial_merge_size)

    def message_images(self, messages: Sequence[dict]) -> list[str]:
        return VisionProcessor.message_images(messages)

    def prompt(self, text: str, refs: Sequence[str]) -> str:
        return VisionProcessor.prompt(text, refs) if refs else text

    def image_prompts(self, texts: Iterable[str], refs: Sequence[Sequence[str]]) -> list[str] | None:
        return [VisionProcessor.prompt(t, r) for t, r in zip(texts, refs)] if any(refs) else None

    def image_part(self, url: str) -> dict:
        return {"type": "image", "image": url}

    def prompt_ids(self, text: str, refs: Sequence[str]) -> list[int]:
        return self.processor.ids(text, refs)

    def check_plain_ids(self, ids: Sequence[int]) -> None:
        if self.processor.image_token_id in ids:
            raise ValueError(f"the prompt holds {IMAGE_TOKEN} tokens")


@dataclass(frozen=True)
class ImageInputs:
    """A forward's inputs over B rows with images beside their ids [B, T] and mask [B, T]:
    M-RoPE ``position_ids`` [3, B, T], ``mm_token_type_ids`` [B, T] (1 on the tokens the images'
    features go to), ``pixel_values`` [P, D] and ``image_grid_thw`` [g, 3] in row order, and the
    model's spatial ``merge_size`` (a grid (t, h, w) is t*h*w patches, t*h*w / merge^2 tokens)."""

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    mm_token_type_ids: Tensor
    pixel_values: Tensor
    image_grid_thw: Tensor
    merge_size: int
    whole_rows: bool = True

    def padded(self, body: nn.Module, columns: int) -> tuple[dict[str, Any], ContextManager]:
        types = self.mm_token_type_ids[:, :columns]  # (the last token is never an image token)
        return ({"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw,
                 "mm_token_type_ids": types, "position_ids": self.position_ids[..., :columns]},
                typed_image_tokens(body, types))  # a sampled placeholder id is text

    def packed(self, body: nn.Module, rows: Sequence[int], starts: Sequence[int],
               lengths: Sequence[int]) -> tuple[dict[str, Any], ContextManager]:
        ids, text, rope, types, pixels, grids = [], [], [], [], [], []
        spans, patch_start = self._image_spans()
        for b in rows:
            s, n = starts[b], lengths[b]
            ids.append(self.input_ids[b, s:s + n])
            text.append(torch.arange(n, device=self.input_ids.device))
            rope.append(self.position_ids[:, b, s:s + n])
            types.append(self.mm_token_type_ids[b, s:s + n])
            g0, g1 = spans[b]
            if g1 > g0:
                grids.append(self.image_grid_thw[g0:g1])
                pixels.append(self.pixel_values[patch_start[g0]:patch_start[g1]])
        S = sum(lengths[b] for b in rows)
        images = {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids)} if grids else {}
        positions = torch.cat([torch.cat(text).view(1, -1), torch.cat(rope, dim=1).to(torch.long)],
                              dim=0).unsqueeze(1)  # (4, 1, S)
        row_types = torch.cat(types).view(1, S)
        return ({"input_ids": torch.cat(ids).view(1, S), "position_ids": positions, "mm_token_type_ids": row_types,
                 **images}, typed_image_tokens(body, row_types))

    def _image_spans(self) -> tuple[list[tuple[int, int]], list[int]]:
        """Each row's images (grids g0..g1) and the first patch of each image, in row order."""
        per_grid_tokens = (self.image_grid_thw.prod(-1) // self.merge_size ** 2).tolist()
        spans, g = [], 0
        for n in self.mm_token_type_ids.sum(1).tolist():
            take = 0
            while n > 0:
                n -= per_grid_tokens[g + take]
                take += 1
            spans.append((g, g + take))
            g += take
        return spans, [0] + self.image_grid_thw.prod(-1).cumsum(0).tolist()

    def to(self, device: torch.device) -> "ImageInputs":
        return replace(self, input_ids=self.input_ids.to(device), attention_mask=self.attention_mask.to(device),
                       position_ids=self.position_ids.to(device), mm_token_type_ids=self.mm_token_type_ids.to(device),
                       pixel_values=self.pixel_values.to(device), image_grid_thw=self.image_grid_thw.to(device))


@contextmanager
def typed_image_tokens(body: nn.Module, mm_token_type_ids: Tensor) -> Iterator[None]:
    """Within it, a forward of the backbone ``body`` (a Qwen2-VL-family ``model.model``) places
    the images' features on the tokens ``mm_token_type_ids`` marks (:meth:`Qwen2VLKind.image_inputs`),
    not on every placeholder id: a response may hold the placeholder id as text. The model's
    forward is otherwise its own (Qwen3-VL's deepstack features follow the same positions); it
    still checks that the marked tokens and the images' features agree in number."""
    inner = getattr(body, "_orig_mod", body)  # a compiled body's module

    def placeholders(input_ids, inputs_embeds, image_features=None, video_features=None):
        image = (mm_token_type_ids == 1).to(inputs_embeds.device)
        if image_features is not None and int(image.sum()) != image_features.shape[0]:
            raise ValueError(f"{int(image.sum())} image tokens but {image_features.shape[0]} image features")
        image = image.unsqueeze(-1).expand_as(inputs_embeds)
        return image, torch.zeros_like(image)

    inner.get_placeholder_mask = placeholders  # the instance's, over its class's method
    try:
        yield
    finally:
        del inner.get_placeholder_mask


def _rope(model: nn.Module) -> nn.Module:
    """The module holding ``get_rope_index`` (``Qwen2VLModel``, under the *ForConditionalGeneration)."""
    inner = getattr(model, "model", model)
    inner = getattr(inner, "base_model", inner) if not hasattr(inner, "get_rope_index") else inner
    if not hasattr(inner, "get_rope_index"):
        inner = model.get_base_model().model  # a peft wrapper
    return inner


# ----------------------------------------------------------------- single sequences (the reference)

@dataclass(frozen=True)
class VisionSequence:
    """One prompt and response of a VLM rollout, with its images.

    input_ids          [n]     prompt then response tokens (no padding)
    mm_token_type_ids  [n]     1 on image tokens, 0 elsewhere
    pixel_values       [P, D]  the prompt's images' patches, in order (P = 0: no image)
    image_grid_thw     [g, 3]  each image's (t, h, w) patch grid
    prompt_len                 p: the response starts at this token
    images                     where the images came from (paths or "data:" tags), for samples.jsonl
    """

    input_ids: Tensor
    mm_token_type_ids: Tensor
    pixel_values: Tensor
    image_grid_thw: Tensor
    prompt_len: int
    images: tuple[str, ...] = field(default=())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def _sequence_images(seqs: Sequence[VisionSequence]) -> dict[str, Tensor]:
    with_images = [s for s in seqs if s.image_grid_thw.numel()]
    if not with_images:
        return {}
    return {"pixel_values": torch.cat([s.pixel_values for s in with_images]),
            "image_grid_thw": torch.cat([s.image_grid_thw for s in with_images])}


def _positions(model: nn.Module, ids: Tensor, types: Tensor, grid: Tensor | None, mask: Tensor | None) -> Tensor:
    if grid is None:  # text only: plain positions on all three axes
        pos = (mask.cumsum(-1) - 1).clamp(min=0) if mask is not None else torch.arange(ids.shape[1]).expand_as(ids)
        return pos.unsqueeze(0).expand(3, -1, -1)
    positions, _ = _rope(model).get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid,
                                               attention_mask=mask)
    return positions


def padded_inputs(model: nn.Module, seqs: Sequence[VisionSequence], pad_id: int) -> dict[str, Tensor]:
    """The N sequences right-padded in [N, T] rows with M-RoPE positions (3, N, T)."""
    T = max(s.num_tokens for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    types = torch.zeros((len(seqs), T), dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :s.num_tokens] = s.input_ids
        types[b, :s.num_tokens] = s.mm_token_type_ids
        mask[b, :s.num_tokens] = 1
    images = _sequence_images(seqs)
    positions = _positions(model, ids, types, images.get("image_grid_thw"), mask)
    return {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": types, "position_ids": positions,
            **images}


def packed_inputs(model: nn.Module, seqs: Sequence[VisionSequence]) -> dict[str, Tensor]:
    """The N sequences end to end in one row of S = sum n_i tokens: positions (4, 1, S) (text
    positions restarting per sequence, then each sequence's own M-RoPE positions), no
    attention mask (transformers finds the sequences from the restarting text positions)."""
    rows = []
    for s in seqs:
        ids = s.input_ids.unsqueeze(0)
        grid = s.image_grid_thw if s.image_grid_thw.numel() else None
        rope = _positions(model, ids, s.mm_token_type_ids.unsqueeze(0), grid, None)
        text = torch.arange(s.num_tokens).view(1, 1, -1)
        rows.append(torch.cat([text, rope.to(text.dtype)], dim=0))
    return {"input_ids": torch.cat([s.input_ids for s in seqs]).unsqueeze(0),
            "mm_token_type_ids": torch.cat([s.mm_token_type_ids for s in seqs]).unsqueeze(0),
            "position_ids": torch.cat(rows, dim=2), **_sequence_images(seqs)}


def _response_logprobs(logits: Tensor, ids: Tensor, start: int, end: int, temperature: float) -> Tensor:
    """Logprobs of tokens ids[start:end] from the logits predicting them (logits[start-1:end-1])."""
    pred = logits[start - 1:end - 1].float() / temperature
    return torch.log_softmax(pred, dim=-1).gather(-1, ids[start:end].unsqueeze(-1)).squeeze(-1)


def sequence_logprobs(model: nn.Module, seqs: Sequence[VisionSequence], *, pad_id: int, packed: bool = False,
                      temperature: float = 1.0) -> list[Tensor]:
    """Each sequence's response-token logprobs [r_i] under ``model`` (grad as the caller's mode),
    from one padded or one packed forward."""
    if packed:
        inputs = packed_inputs(model, seqs)
        logits = model(**inputs, use_cache=False).logits[0]
        out, offset = [], 0
        for s in seqs:
            out.append(_response_logprobs(logits[offset:offset + s.num_tokens], s.input_ids, s.prompt_len,
                                          s.num_tokens, temperature))
            offset += s.num_tokens
        return out
    inputs = padded_inputs(model, seqs, pad_id)
    logits = model(**inputs, use_cache=False).logits
    return [_response_logprobs(logits[b], s.input_ids, s.prompt_len, s.num_tokens, temperature)
            for b, s in enumerate(seqs)]
