"""Qwen2.5-VL and Qwen3-VL policies (tiny random models shaped like the released ones:
tests/fixtures/vlm_families.py): the processor built without torchvision from the folder, the HF
engine sampling from prompts with images, and exact training rows -- the trainer's forward with
the rows' pixel values, grids, token types and M-RoPE positions recomputes the engine's
logprobs, and packed rows (one and several) equal padded ones below 1e-6."""
from __future__ import annotations

import pytest
import torch

import vlm_families
import vlm_model as fixture
from rldsl.runtime.batch import model_inputs
from rldsl.runtime.models.loading import is_vision_folder, load_policy, load_tokenizer
from rldsl.runtime.models.vision import VisionPrompt, load_processor
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs
from rldsl.runtime.train.throughput import TokenCount
from rldsl.runtime.models.kinds import model_kind

#: (patch size, values per patch: 3 channels x temporal 2 x patch^2) of each family
PATCH = {"qwen2_5_vl": (14, 3 * 2 * 14 * 14), "qwen3_vl": (16, 3 * 2 * 16 * 16)}


def _messages(question: str, n_images: int) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": f"{i}.png"} for i in range(n_images)),
                                         {"type": "text", "text": question}]}]


@pytest.mark.parametrize("family", vlm_families.FAMILIES)
def test_family_generates_and_its_rows_are_exact(vlm_family_model, family, tmp_path):
    folder = vlm_family_model(family)
    assert is_vision_folder(folder)
    patch, dim = PATCH[family]
    processor = load_processor(folder)
    text = processor.render(_messages("Colour?", 1))
    assert "<|vision_start|><|image_pad|><|vision_end|>Colour?<|im_end|>\n<|im_start|>assistant\n" in text
    # images of 2x2, 4x2 and 3x3 merged patches of the family's patch size
    sizes = [(4 * patch, 4 * patch), (8 * patch, 4 * patch), (6 * patch, 6 * patch)]
    paths = []
    for i, size in enumerate(sizes):
        paths.append(str(tmp_path / f"{i}.png"))
        fixture.image(i, size).save(paths[-1])
    enc = processor.encode_refs(processor.render(_messages("Q", 1)), [paths[1]])
    assert enc["image_grid_thw"].tolist() == [[1, 4, 8]] and enc["pixel_values"].shape == (32, dim)

    torch.manual_seed(0)
    model = load_policy(folder, "float32").eval()
    engine = HFEngine(model, load_tokenizer(folder))
    prompts = [VisionPrompt(processor.render(_messages("Colour?", 1)), [paths[0]]),
               VisionPrompt(processor.render(_messages("Where is the box?", 2)), [paths[1], paths[2]]),
               processor.render(_messages("No picture.", 0))]
    batch = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=5, min_new_tokens=5, seed=3))
    image_id = processor.image_token_id
    assert [int((batch.prompt_ids[i] == image_id).sum()) for i in range(0, 6, 2)] == [4, 8 + 9, 0]
    ids, attn, _ = model_inputs(batch)
    vision = model_kind(model).image_inputs(model, model_kind(model).processed(batch.images), ids, attn)
    Tr = batch.response_ids.shape[1]
    with torch.no_grad():
        padded = token_logprobs(model, Forward(ids, attn, Tr, inputs=vision)).logprobs
        count = TokenCount()
        packed = token_logprobs(model, Forward(ids, attn, Tr, inputs=vision),
                                LogprobOptions(packing=True, count=count)).logprobs
        rows2 = token_logprobs(model, Forward(ids, attn, Tr, inputs=vision),
                               LogprobOptions(packing=True, packing_row_tokens=int(attn.sum(1).max()) + 1)).logprobs  # several packed rows
        blind = token_logprobs(model, Forward(ids, attn, Tr)).logprobs  # text positions, no pixels
    m = batch.response_mask.bool()
    assert (padded[m] - batch.logprobs[m]).abs().max() < 1e-5, (padded[m] - batch.logprobs[m]).abs().max()
    assert (packed[m] - padded[m]).abs().max() < 1e-6 and (rows2[m] - padded[m]).abs().max() < 1e-6
    assert count.computed == int(attn.sum()) < attn.numel()  # the packed rows hold real tokens only
    assert (blind[m] - batch.logprobs[m]).abs().max() > 1e-3  # the images matter
