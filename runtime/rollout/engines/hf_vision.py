"""The HF engine's generation for prompts with images (a vision-language policy; docs/vlm.md).

Each prompt is a ``VisionPrompt`` (data/images.py): the chat template's text with one
``<|image_pad|>`` per image, and its images' refs. The policy's processor (models/vision.py)
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
from ...models.vision import processor_for
from .base import SamplingParams, left_pad


def generate_with_images(engine: Any, prompts: list[str], params: SamplingParams) -> RolloutBatch:
    """``engine.generate`` (an ``HFEngine``) for prompts some of which carry images."""
    processor = processor_for(engine.model, engine.tokenizer)
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

