"""The HF engine's generation for prompts with images (a vision-language policy; docs/vlm.md).

Each prompt is a ``VisionPrompt`` (models/vision.py): the chat template's text with one
``<|image_pad|>`` per image, and its images' refs. The policy's processor (its kind's: models/kinds/qwen2_vl.py)
expands each placeholder into one token per merged patch and computes the pixel values; the P
prompts are left padded, repeated G times, their images' pixel values and grids laid out in row
order, and ``model.generate`` samples (it drives M-RoPE: positions from ``get_rope_index`` at
prefill, ``rope_deltas`` while decoding). ``prompt_ids`` in the batch are the expanded ids, so
the trainer's forwards see exactly the tokens the engine saw; their images travel with the
prompts. Logprobs are those of the raw logits at temperature tau, as for text prompts.
"""
from __future__ import annotations

from typing import Any

import torch

from ...batch import RolloutBatch
from ...data.images import images_of
from .base import SamplingParams, left_pad


def generate_with_images(engine: Any, prompts: list[str], params: SamplingParams) -> RolloutBatch:
    """``engine.generate`` (an ``HFEngine``) for prompts some of which carry images."""
    processor = engine.kind.processor
    encoded = [processor.encode_refs(str(p), images_of(p)) for p in prompts]
    ids, mask = left_pad([e["input_ids"][0].tolist() for e in encoded], engine.pad_id)  # [P, Tp]
    types, _ = left_pad([e["mm_token_type_ids"][0].tolist() for e in encoded], 0)
    G = params.n
    rows = [e for e in encoded for _ in range(G)]  # each row's images, in row order
    with_images = [e for e in rows if "pixel_values" in e]
    vision = {"mm_token_type_ids": types.repeat_interleave(G, dim=0).to(engine.device)}
    if with_images:
        vision["pixel_values"] = torch.cat([e["pixel_values"] for e in with_images]).to(engine.device)
        vision["image_grid_thw"] = torch.cat([e["image_grid_thw"] for e in with_images]).to(engine.device)
    return engine._generate_padded(ids.to(engine.device), mask.to(engine.device), prompts, params, **vision)



def generate_ids_with_images(engine: Any, prompt_ids: list[list[int]], prompts: list[str],
                             params: SamplingParams) -> RolloutBatch:
    """``engine.generate_ids`` (an ``HFEngine``) for prompt ids whose image tokens are expanded
    already (a multi-turn episode's or an agent's turn: docs/vlm.md), each prompt carrying the refs
    of the images those tokens stand for, in order (``prompts``: ``VisionPrompt``)."""
    processor = engine.kind.processor
    ids, mask = left_pad(prompt_ids, engine.pad_id)  # [P, Tp]
    types = (ids == processor.image_token_id).long()  # [P, Tp]
    G = params.n
    pixels, grids = [], []
    for p, row in zip(prompts, types):
        refs = images_of(p)
        if not refs:
            if int(row.sum()):
                raise ValueError("a prompt holds image tokens but no images")
            continue
        vision = processor.image_inputs(refs)
        want = int((vision["image_grid_thw"].prod(-1) // processor.merge_size ** 2).sum())
        if want != int(row.sum()):
            raise ValueError(f"a prompt holds {int(row.sum())} image tokens but its {len(refs)} images "
                             f"make {want}")
        pixels += [vision["pixel_values"]] * G
        grids += [vision["image_grid_thw"]] * G
    extra = {"mm_token_type_ids": types.repeat_interleave(G, dim=0).to(engine.device)}
    if grids:
        extra["pixel_values"] = torch.cat(pixels).to(engine.device)
        extra["image_grid_thw"] = torch.cat(grids).to(engine.device)
    return engine._generate_padded(ids.to(engine.device), mask.to(engine.device), prompts, params, **extra)
