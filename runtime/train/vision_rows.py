"""Training forwards of a vision-language policy: each sequence with its images' pixel values,
grids and token types, M-RoPE positions per sequence, padded or packed.

A Qwen2-VL-family model places image tokens on a (temporal, height, width) grid: its position
ids are (3, B, T), and the text after an image resumes at the image's offset + max(h, w) / merge,
not at its token count. A forward must therefore get ``pixel_values``, ``image_grid_thw`` and
``mm_token_type_ids`` (without the token types transformers refuses, or -- older releases --
silently positions the images as text), and positions computed per sequence.

Padded (:func:`padded_inputs`): sequences right-padded in B rows, positions from the model's
``get_rope_index`` with the attention mask. Packed (:func:`packed_inputs`): the sequences end
to end in one row, each sequence's ``get_rope_index`` positions concatenated under a leading row
of per-sequence text positions (0, 1, ... restarting at every sequence: shape (4, 1, S)), from
which transformers builds the block-diagonal causal mask; pixel values, grids and token types
concatenated in row order. Letting the model compute positions on a packed row is wrong (the
second sequence's positions would continue the first's). Both give the same logprobs as
``generate`` (tests/runtime/test_vlm.py).

Micro-batches (:func:`micro_batches`) split by whole sequences, so a sequence's images always
travel with it; a micro-batch's ``pixel_values`` are its sequences' patches only.

Shapes: N sequences of n_i tokens (prompt p_i + response r_i), P_i patches of D = C * temporal
* patch^2 values each, g_i images.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import Tensor, nn

from ..models.vision import processor_for
from .microbatch import pack


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


def _vision(seqs: Sequence[VisionSequence]) -> dict[str, Tensor]:
    with_images = [s for s in seqs if s.image_grid_thw.numel()]
    if not with_images:
        return {}
    return {"pixel_values": torch.cat([s.pixel_values for s in with_images]),
            "image_grid_thw": torch.cat([s.image_grid_thw for s in with_images])}


def _rope(model: nn.Module) -> nn.Module:
    """The module holding ``get_rope_index`` (``Qwen2VLModel``, under the *ForConditionalGeneration)."""
    inner = getattr(model, "model", model)
    inner = getattr(inner, "base_model", inner) if not hasattr(inner, "get_rope_index") else inner
    if not hasattr(inner, "get_rope_index"):
        inner = model.get_base_model().model  # a peft wrapper
    return inner


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
    vision = _vision(seqs)
    positions = _positions(model, ids, types, vision.get("image_grid_thw"), mask)
    return {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": types, "position_ids": positions,
            **vision}


def _positions(model: nn.Module, ids: Tensor, types: Tensor, grid: Tensor | None, mask: Tensor | None) -> Tensor:
    if grid is None:  # text only: plain positions on all three axes
        pos = (mask.cumsum(-1) - 1).clamp(min=0) if mask is not None else torch.arange(ids.shape[1]).expand_as(ids)
        return pos.unsqueeze(0).expand(3, -1, -1)
    positions, _ = _rope(model).get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid,
                                               attention_mask=mask)
    return positions


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
            "position_ids": torch.cat(rows, dim=2), **_vision(seqs)}


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


def micro_batches(seqs: Sequence[VisionSequence], token_budget: int) -> list[list[int]]:
    """Indices of ``seqs`` in micro-batches of at most ``token_budget`` tokens each (a longer
    sequence alone): whole sequences, each with all its images."""
    return pack([s.num_tokens for s in seqs], token_budget)


def vision_inputs(model: nn.Module, refs: Sequence[Sequence[str]], input_ids: Tensor,
                  attention_mask: Tensor, response_tokens: int = 0,
                  sampled: Tensor | None = None) -> dict[str, Tensor] | None:
    """The image inputs of a trainer forward over B rollout rows (prompt left padded, response
    right padded: [B, T], the last ``response_tokens`` columns the responses) whose ids hold
    images (``refs``: each row's references, ``RolloutBatch.images``): pixel values and grids in row order,
    ``mm_token_type_ids`` [B, T], M-RoPE ``position_ids`` [3, B, T] over each row's real tokens.
    None when no prompt has an image.

    Only the prompts' image placeholders are image tokens: a response may hold the placeholder id
    too (a policy can sample any token), which the engine fed back as a text token -- its own
    embedding at the next text position -- and so does the forward (:func:`typed_image_tokens`).
    ``sampled`` [B, response_tokens]: 1 where the policy sampled the response token (an episode's
    response also holds the environment's messages, whose images are images); None: all of them."""
    if not any(refs):
        return None
    processor = processor_for(model)
    device = input_ids.device
    vision = processor.image_inputs([r for row in refs for r in row])
    types = (input_ids == processor.image_token_id).long()
    if response_tokens:  # a sampled placeholder is text
        tail = types[:, input_ids.shape[1] - response_tokens:]
        tail.mul_(0 if sampled is None else (sampled == 0).long())
    grid = vision["image_grid_thw"].to(device)
    positions, _ = _rope(model).get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grid,
                                               attention_mask=attention_mask)
    return {"pixel_values": vision["pixel_values"].to(device), "image_grid_thw": grid,
            "mm_token_type_ids": types, "position_ids": positions}


def packed_vision_hidden(body: nn.Module, input_ids: Tensor, attention_mask: Tensor, num_response_tokens: int,
                         vision: dict[str, Tensor], merge_size: int, row_tokens: int | None = None
                         ) -> tuple[Tensor, int]:
    """The backbone's last hidden states [B, Tr, H] predicting the response tokens of B padded
    rows (prompt left padded, response right padded), computed on packed rows: each row's real
    tokens (one contiguous run) end to end, at most ``row_tokens`` tokens a packed row (whole
    sequences; None: the longest sequence's length, so no packed row's attention is larger than
    a padded row's), with the positions ``vision`` holds for them (``vision_inputs``:
    each sequence's own M-RoPE positions) under per-sequence text positions, (4, 1, S), and each
    packed row's pixel values and grids (its sequences', in order). Zeros where a row has no
    response token. Also returns the tokens computed (sum of the packed rows' lengths)."""
    B, T = input_ids.shape
    Tr = num_response_tokens
    lengths = attention_mask.long().sum(1).tolist()  # [B] real tokens a row
    prompt_len = attention_mask[:, : T - Tr].long().sum(1).tolist()  # [B]
    starts = [T - Tr - p for p in prompt_len]  # each row's first real token
    types = vision["mm_token_type_ids"]
    image_tokens = types.sum(1).tolist()  # [B]
    grids = vision["image_grid_thw"] if "image_grid_thw" in vision else None
    # each row's images (grids) and patches, in row order: a grid is (t, h, w) -> t*h*w patches,
    # t*h*w / merge^2 tokens
    per_grid_tokens = (grids.prod(-1) // merge_size ** 2).tolist() if grids is not None else []
    grid_rows, g = [], 0
    for n in image_tokens:
        take = 0
        while n > 0:
            n -= per_grid_tokens[g + take]
            take += 1
        grid_rows.append((g, g + take))
        g += take
    patch_start = [0] + (grids.prod(-1).cumsum(0).tolist() if grids is not None else [])
    hidden_out = None
    computed = 0
    for rows in pack(lengths, row_tokens or max(lengths)):  # None: as train.packing_row_tokens says
        if not rows:
            continue
        ids, text, rope, tt, pix, grid = [], [], [], [], [], []
        for b in rows:
            s, n = starts[b], lengths[b]
            ids.append(input_ids[b, s:s + n])
            text.append(torch.arange(n, device=input_ids.device))
            rope.append(vision["position_ids"][:, b, s:s + n])
            tt.append(types[b, s:s + n])
            g0, g1 = grid_rows[b]
            if g1 > g0:
                grid.append(grids[g0:g1])
                pix.append(vision["pixel_values"][patch_start[g0]:patch_start[g1]])
        S = sum(lengths[b] for b in rows)
        computed += S
        images = {"pixel_values": torch.cat(pix), "image_grid_thw": torch.cat(grid)} if grid else {}
        positions = torch.cat([torch.cat(text).view(1, -1), torch.cat(rope, dim=1).to(torch.long)],
                              dim=0).unsqueeze(1)  # (4, 1, S)
        row_types = torch.cat(tt).view(1, S)
        with typed_image_tokens(body, row_types):
            hidden = body(input_ids=torch.cat(ids).view(1, S), position_ids=positions, mm_token_type_ids=row_types,
                          use_cache=False, **images).last_hidden_state[0]
        if hidden_out is None:
            hidden_out = hidden.new_zeros(B, Tr, hidden.shape[-1])
        offset = 0
        for b in rows:
            r = lengths[b] - prompt_len[b]  # real response tokens
            if r > 0:  # token j of the response is predicted by the state before it
                first = offset + prompt_len[b] - 1
                hidden_out[b, :r] = hidden[first:first + r]
            offset += lengths[b]
    return hidden_out, computed


@contextmanager
def typed_image_tokens(body: nn.Module, mm_token_type_ids: Tensor) -> Iterator[None]:
    """Within it, a forward of the backbone ``body`` (a Qwen2-VL-family ``model.model``) places
    the images' features on the tokens ``mm_token_type_ids`` marks (:func:`vision_inputs`), not on
    every placeholder id: a response may hold the placeholder id as text. The model's forward is
    otherwise its own (Qwen3-VL's deepstack features follow the same positions); it still checks
    that the marked tokens and the images' features agree in number."""
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
