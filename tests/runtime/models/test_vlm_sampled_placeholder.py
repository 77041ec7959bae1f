"""A response that holds the image placeholder token (a policy may sample any token: the shapes
demo's did within 10 steps) is text to the engine -- ``generate`` feeds it back with its own
embedding at the next text position -- and must be to the trainer's forwards too: they crashed
(M-RoPE's ``get_rope_index`` counted it as an image token, the model's forward as a placeholder
without features). Padded and packed, the recomputed logprobs equal ``generate``'s."""
from __future__ import annotations

import torch

import vlm_model as fixture
from rldsl.runtime.models.loading import load_policy
from rldsl.runtime.models.vision import load_processor
from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs
from rldsl.runtime.models.kinds import model_kind


def test_a_sampled_image_placeholder_is_a_text_token_to_the_trainer(vlm_model, tmp_path):
    model, processor = load_policy(vlm_model, "float32").eval(), load_processor(vlm_model)
    path = fixture.images(tmp_path, 1)[0]
    text = processor.render([{"role": "user", "content": [{"type": "image", "image": str(path)},
                                                          {"type": "text", "text": "Colour?"}]}])
    enc = processor.encode_refs(text, [str(path)])
    tok = processor.tokenizer
    forced = [tok.convert_tokens_to_ids("red"), processor.image_token_id, processor.image_token_id, tok.eos_token_id]
    p = enc["input_ids"].shape[1]
    with torch.no_grad():  # generate, made to sample exactly ``forced``: the engine's logprobs of them
        out = model.generate(**enc, max_new_tokens=len(forced), min_new_tokens=len(forced), do_sample=False,
                             prefix_allowed_tokens_fn=lambda b, ids: [forced[len(ids) - p]],
                             output_logits=True, return_dict_in_generate=True)
    assert out.sequences[0, p:].tolist() == forced
    engine = torch.stack([torch.log_softmax(s[0].float(), -1)[t] for s, t in zip(out.logits, forced)])
    # two rows: the one above, and the same prompt with a shorter response (right padded)
    Tr = len(forced)
    ids = torch.cat([out.sequences, torch.cat([enc["input_ids"], torch.tensor([forced[:2] + [tok.pad_token_id] * 2])], 1)])
    attn = torch.ones_like(ids)
    attn[1, -2:] = 0
    vision = model_kind(model).image_inputs(model, model_kind(model).processed([[str(path)]] * 2), ids, attn, Tr)
    assert vision.mm_token_type_ids[:, -Tr:].sum() == 0  # the prompt's 4 image tokens only
    assert vision.mm_token_type_ids.sum(1).tolist() == [4, 4]
    with torch.no_grad():
        padded = token_logprobs(model, Forward(ids, attn, Tr, inputs=vision)).logprobs
        packed = token_logprobs(model, Forward(ids, attn, Tr, inputs=vision), LogprobOptions(packing=True)).logprobs
    assert (padded[0] - engine).abs().max() < 1e-5
    assert (padded[1, :2] - engine[:2]).abs().max() < 1e-5
    assert (packed[attn[:, -Tr:].bool()] - padded[attn[:, -Tr:].bool()]).abs().max() < 1e-6
