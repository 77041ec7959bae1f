"""Vision-language policies on the tiny random Qwen2-VL (tests/fixtures/vlm_model.py): the
processor built without torchvision, generate's logprobs == a recomputed forward's (padded and
packed with M-RoPE positions per sequence), micro-batches of whole sequences, the frozen
vision tower and language-only LoRA targets."""
from __future__ import annotations

import re

import pytest
import torch

import vlm_model as fixture
from rldsl.runtime.models.loading import is_vision_folder, load_policy
from rldsl.runtime.models.loading import freeze_vision
from rldsl.runtime.models.vision import IMAGE_TOKEN, language_lora_targets, load_processor
from rldsl.runtime.models.kinds.qwen2_vl import VisionSequence, packed_inputs, padded_inputs, sequence_logprobs
from rldsl.runtime.train.microbatch import pack

QUESTIONS = ["What colour is the square?", "Where is the box?", "Describe it.", "Is the square red?"]


@pytest.fixture(scope="module")
def policy(vlm_model):
    torch.manual_seed(0)
    return load_policy(vlm_model, "float32").eval(), load_processor(vlm_model)


def _messages(question: str, n_images: int) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": f"{i}.png"} for i in range(n_images)),
                                         {"type": "text", "text": question}]}]


def _generated(model, processor, question: str, pics: list, new_tokens: int = 6, seed: int = 0):
    """(VisionSequence, generate's logprobs of its sampled tokens)."""
    enc = processor.encode(processor.render(_messages(question, len(pics))), pics)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                             top_k=0, top_p=1.0, temperature=1.0, output_logits=True, return_dict_in_generate=True)
    p = enc["input_ids"].shape[1]
    new = out.sequences[0, p:]
    lp = torch.stack([torch.log_softmax(s[0].float(), -1)[t] for s, t in zip(out.logits, new)])
    ids = out.sequences[0]
    types = torch.cat([enc["mm_token_type_ids"][0], torch.zeros(len(new), dtype=torch.long)])
    empty = torch.zeros((0, 3), dtype=torch.long)
    seq = VisionSequence(ids, types, enc.get("pixel_values", torch.zeros(0, 1176)),
                         enc.get("image_grid_thw", empty), p)
    return seq, lp


def test_folder_and_processor_without_torchvision(vlm_model, policy):
    import importlib.util
    assert importlib.util.find_spec("torchvision") is None  # what the CPU install has: the point of this path
    assert is_vision_folder(vlm_model)
    _, processor = policy
    text = processor.render(_messages("Q", 2))
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2  # the released template's parts
    enc = processor.encode(text, [fixture.image(0, (56, 56)), fixture.image(1, (112, 56))])
    # 56x56 -> 4x4 patches -> 4 tokens after the 2x2 merge; 112x56 -> 8x4 -> 8 tokens
    assert enc["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    assert enc["pixel_values"].shape == (16 + 32, 3 * 2 * 14 * 14)
    assert int(enc["mm_token_type_ids"].sum()) == 12
    assert int((enc["input_ids"] == processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)).sum()) == 12
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        processor.encode(text, [fixture.image(0)])


def test_generate_logprobs_equal_recomputed_padded_and_packed(policy):
    model, processor = policy
    sizes = [(56, 56), (112, 56), (56, 84)]
    made = [_generated(model, processor, QUESTIONS[i], [fixture.image(i, sizes[i])], seed=i) for i in range(3)]
    made.append(_generated(model, processor, QUESTIONS[3], [fixture.image(7), fixture.image(8, (84, 84))], seed=3))
    made.append(_generated(model, processor, "No picture here.", [], seed=4))
    seqs = [s for s, _ in made]
    assert len({s.num_tokens for s in seqs}) > 1  # padding really happens
    pad = processor.tokenizer.pad_token_id
    with torch.no_grad():
        alone = [sequence_logprobs(model, [s], pad_id=pad)[0] for s in seqs]
        padded = sequence_logprobs(model, seqs, pad_id=pad)
        packed = sequence_logprobs(model, seqs, pad_id=pad, packed=True)
    for (_, gen), a, b, c in zip(made, alone, padded, packed):
        assert torch.allclose(gen, a, atol=1e-5), (gen - a).abs().max()
        assert torch.allclose(gen, b, atol=1e-5), (gen - b).abs().max()
        assert (b - c).abs().max() < 1e-6  # packed == padded


def test_packed_positions_are_per_sequence(policy):
    """The text after an image resumes at offset + max(h, w)/merge in each packed sequence; the
    model's own positions on the packed row would continue across sequences (the wrong ones)."""
    model, processor = policy
    seqs = [_generated(model, processor, QUESTIONS[i], [fixture.image(i, (112, 56))], new_tokens=2, seed=i)[0]
            for i in range(2)]
    packed = packed_inputs(model, seqs)
    pos = packed["position_ids"]
    assert pos.shape == (4, 1, sum(s.num_tokens for s in seqs))
    n0 = seqs[0].num_tokens
    assert pos[0, 0, n0] == 0 and pos[1:, 0, n0].tolist() == [0, 0, 0]  # the second sequence restarts
    padded = padded_inputs(model, seqs, processor.tokenizer.pad_token_id)
    for b, s in enumerate(seqs):
        start = sum(x.num_tokens for x in seqs[:b])
        assert torch.equal(pos[1:, 0, start:start + s.num_tokens], padded["position_ids"][:, b, :s.num_tokens])
    # an 8x4 grid of 8 tokens advances positions by max(8, 4)/2 = 4, not 8
    assert int(pos[1, 0, n0 - 1]) < n0 - 1
    assert packed["pixel_values"].shape[0] == sum(s.pixel_values.shape[0] for s in seqs)


def test_micro_batches_keep_sequences_whole_with_their_images(policy):
    model, processor = policy
    seqs = [_generated(model, processor, QUESTIONS[i % 4], [fixture.image(i)] * (1 + i % 2), new_tokens=2, seed=i)[0]
            for i in range(5)]
    budget = max(s.num_tokens for s in seqs) + 5
    bins = pack([s.num_tokens for s in seqs], budget)
    assert sorted(i for b in bins for i in b) == list(range(5)) and len(bins) > 1
    for b in bins:
        part = [seqs[i] for i in b]
        assert sum(s.num_tokens for s in part) <= budget or len(b) == 1
        inputs = packed_inputs(model, part)  # each micro-batch carries exactly its own images' patches
        assert inputs["pixel_values"].shape[0] == sum(s.pixel_values.shape[0] for s in part)
        assert int(inputs["mm_token_type_ids"].sum()) == int(inputs["image_grid_thw"].prod(-1).sum()) // 4


def test_freeze_vision_and_language_only_lora(policy, vlm_model):
    model = load_policy(vlm_model, "float32")
    frozen = freeze_vision(model)
    vision = [n for n, _ in model.named_parameters() if ".visual." in f".{n}"]
    assert vision and frozen == sum(p.numel() for n, p in model.named_parameters() if n in vision)
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in vision)
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in vision)
    pattern = re.compile(language_lora_targets(model, ["q_proj", "v_proj", "qkv", "proj"]))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    hit = [n for n in names if pattern.match(n)]
    assert hit and not any("visual" in n for n in hit)
    assert any(n.endswith("self_attn.q_proj") for n in hit)


def test_hf_engine_rollout_and_trainer_logprobs_agree(policy, tmp_path):
    """The HF engine samples from prompts carrying images (VisionPrompt); the trainer's padded
    forward (token_logprobs with the kind's image inputs: pixels, grids, token types, M-RoPE positions)
    recomputes the engine's logprobs; the batch's prompt ids are the expanded ones."""
    from rldsl.runtime.batch import model_inputs
    from rldsl.runtime.models.vision import VisionPrompt
    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.rollout.engines.hf import HFEngine
    from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs
    from rldsl.runtime.train.throughput import TokenCount
    from rldsl.runtime.models.kinds import model_kind
    model, processor = policy
    paths = fixture.images(tmp_path, 3)
    fixture.image(9, (112, 56)).save(tmp_path / "wide.png")
    prompts = [VisionPrompt(processor.render(_messages(QUESTIONS[0], 1)), [str(paths[0])]),
               VisionPrompt(processor.render(_messages(QUESTIONS[1], 2)), [str(tmp_path / "wide.png"), str(paths[2])]),
               processor.render(_messages("No picture.", 0))]
    engine = HFEngine(model, processor.tokenizer)
    batch = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=5, temperature=1.0, seed=3))
    assert batch.prompts[2].images == batch.prompts[3].images == (str(tmp_path / "wide.png"), str(paths[2]))
    image_id = processor.image_token_id
    assert (batch.prompt_ids[0] == image_id).sum() == 4 and (batch.prompt_ids[2] == image_id).sum() == 8 + 4
    assert (batch.prompt_ids[4] == image_id).sum() == 0
    ids, attn, _ = model_inputs(batch)
    vision = model_kind(model).image_inputs(model, model_kind(model).processed(batch.images), ids, attn)
    assert vision.pixel_values.shape[0] == 2 * (16 + 32 + 16)  # each row's own images, G=2 rows each
    with torch.no_grad():
        lp = token_logprobs(model, Forward(ids, attn, batch.response_ids.shape[1], inputs=vision)).logprobs
        wrong = token_logprobs(model, Forward(ids, attn, batch.response_ids.shape[1])).logprobs  # text positions, no pixels
        count = TokenCount()
        packed = token_logprobs(model, Forward(ids, attn, batch.response_ids.shape[1], inputs=vision),
                                LogprobOptions(packing=True, count=count)).logprobs
        rows2 = token_logprobs(model, Forward(ids, attn, batch.response_ids.shape[1], inputs=vision),
                               LogprobOptions(packing=True, packing_row_tokens=int(attn.sum(1).max()) + 1)).logprobs  # several packed rows
    m = batch.response_mask.bool()
    assert (lp[m] - batch.logprobs[m]).abs().max() < 1e-5
    assert (packed[m] - lp[m]).abs().max() < 1e-6 and (rows2[m] - lp[m]).abs().max() < 1e-6  # packed == padded
    assert count.computed == int(attn.sum()) < attn.numel()  # the packed rows hold real tokens only
    assert (wrong[m] - batch.logprobs[m]).abs().max() > 1e-3  # the images matter


@pytest.mark.parametrize("freeze", [True, False])
def test_trainable_freezes_the_vision_tower_by_default(vlm_model, freeze):
    from rldsl.runtime.config import RunConfig
    from rldsl.runtime.recipe import trainable
    cfg = RunConfig()
    assert cfg.model.freeze_vision is True  # the default
    cfg.model.freeze_vision = freeze
    policy, _ = trainable(cfg, load_policy(vlm_model, "float32"), checkpointing=False)
    vision = [p.requires_grad for n, p in policy.named_parameters() if n.startswith("model.visual.")]
    language = [p.requires_grad for n, p in policy.named_parameters() if n.startswith("model.language_model.")]
    assert vision and all(language) and all(not v for v in vision) == freeze and all(vision) != freeze


def test_trainer_packed_rows_are_no_longer_than_the_longest_sequence_by_default(policy, tmp_path):
    """``train.packing_row_tokens`` null packs rows of at most the longest sequence, as for text: it
    put every sequence of the forward in one row (the shapes demo: 128 rows, one row of ~5800
    tokens, its attention ~10x slower than the padded forward) -- and packed == padded still."""
    from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs
    from rldsl.runtime.models.kinds import model_kind
    model, processor = policy
    path = fixture.images(tmp_path, 1)[0]
    text = processor.render([{"role": "user", "content": [{"type": "image", "image": str(path)},
                                                          {"type": "text", "text": "Colour?"}]}])
    prompt = processor.encode_refs(text, [str(path)])["input_ids"]  # [1, P]
    tok = processor.tokenizer
    word = tok.convert_tokens_to_ids("red")
    Tr = 4
    ids = torch.cat([prompt.repeat(4, 1), torch.full((4, Tr), word)], 1)
    attn = torch.ones_like(ids)
    for b, n in enumerate([4, 3, 2, 1]):  # real response tokens, right padded
        attn[b, prompt.shape[1] + n:] = 0
        ids[b, prompt.shape[1] + n:] = tok.pad_token_id
    vision = model_kind(model).image_inputs(model, model_kind(model).processed([[str(path)]] * 4), ids, attn, Tr)
    rows: list[int] = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[1]),
                                                 with_kwargs=True)
    try:
        with torch.no_grad():
            packed = token_logprobs(model, Forward(ids, attn, Tr, inputs=vision), LogprobOptions(packing=True)).logprobs
    finally:
        hook.remove()
    longest = int(attn.sum(1).max())  # the longest sequence
    assert len(rows) > 1 and max(rows) <= longest, rows
    with torch.no_grad():
        padded = token_logprobs(model, Forward(ids, attn, Tr, inputs=vision)).logprobs
    real = attn[:, -Tr:].bool()
    assert (packed[real] - padded[real]).abs().max() < 1e-6
