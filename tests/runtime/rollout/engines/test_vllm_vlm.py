"""The tiny random Qwen2-VL (tests/fixtures/vlm_model.py), Qwen2.5-VL and Qwen3-VL
(tests/fixtures/vlm_families.py) on the real vLLM CPU engine, in the
vLLM venv (no torchvision: rollout/engines/vllm/vision_shim/): prompts carrying images are sent
with ``multi_modal_data``; the prompt ids vLLM expands equal the HF processor's, and its
logprobs equal the trainer's forward with the images' pixels, grids, token types and M-RoPE
positions (docs/vlm.md)."""
from __future__ import annotations

import pytest
import torch

import vlm_model as fixture
from rldsl.runtime.batch import model_inputs
from rldsl.runtime.models.loading import load_policy
from rldsl.runtime.models.vision import VisionPrompt, load_processor
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.train.logprobs import Forward, token_logprobs
from rldsl.runtime.models.kinds import model_kind

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vllm_generates_from_images_as_hf_scores_them(vlm_model, vlm_family_model, family, tmp_path):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL (tests/fixtures/vlm_families.py), each through the shim."""
    from rldsl.runtime.rollout.engines.vllm import VLLMEngine
    vlm_model = vlm_model if family == "qwen2_vl" else vlm_family_model(family)
    processor = load_processor(vlm_model)
    paths = fixture.images(tmp_path, 2)
    fixture.image(9, (112, 56)).save(tmp_path / "wide.png")

    def render(question: str, n: int) -> str:
        return processor.render([{"role": "user", "content": [*({"type": "image"} for _ in range(n)),
                                                              {"type": "text", "text": question}]}])

    prompts = [VisionPrompt(render("Colour?", 1), [str(paths[0])]),
               VisionPrompt(render("Which is wider?", 2), [str(tmp_path / "wide.png"), str(paths[1])]),
               render("No picture.", 0)]
    engine = VLLMEngine(vlm_model, dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True,
                        max_model_len=512, seed=0)
    try:
        batch = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=5, temperature=1.0, seed=3))
    finally:
        engine.close()
    # the prompt ids vLLM expanded are the HF processor's
    for row, p in zip(range(0, 6, 2), prompts):
        want = processor.encode_refs(str(p), getattr(p, "images", ()))["input_ids"][0].tolist()
        got = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        assert got == want
    assert batch.prompts[2].images == (str(tmp_path / "wide.png"), str(paths[1]))
    # and its logprobs are the trainer's forward with the images
    model = load_policy(vlm_model, "float32").eval()
    ids, attn, _ = model_inputs(batch)
    with torch.no_grad():
        lp = token_logprobs(model, Forward(ids, attn, batch.response_ids.shape[1], inputs=model_kind(model).image_inputs(model, model_kind(model).processed(batch.images), ids, attn))).logprobs
    m = batch.response_mask.bool()
    assert (lp[m] - batch.logprobs[m]).abs().max() < 1e-4
