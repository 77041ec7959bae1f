"""The shapes task's embedded model (toy/shapes.py): a tiny Qwen2-VL built here -- a word-level
tokenizer holding Qwen2-VL's special tokens and chat template, a ``Qwen2VLForConditionalGeneration``
(text hidden 64, 2 layers, M-RoPE sections [4, 6, 6]; vision depth 1, embed 32, patch 14, merge 2)
and a ``Qwen2VLImageProcessorPil`` -- with a cached warm start.

The warm start is supervised training on scenes of the training side drawn from its own seed
(the held-out scenes are never read here), on the answers of a teacher with a flaw RL can fix
(as the toy's carry-dropping teacher, toy/warmup.py): asked a colour, it names the colour's twin
(red/orange, blue/purple, green/yellow) with probability ``confuse``; it gets the side right.
Training stops once the model has learned the teacher -- its greedy answer is the teacher's most
likely one on ``mode_target`` of a validation slice -- and settles. The model then reads the
pictures (to tell a colour from its twin it must see it) but names the twin's colour more often
than the true one: greedy colour answers mostly wrong, sampled ones right about 1 - ``confuse``
of the time, so that most groups have mixed rewards. The folder is cached under the rldsl cache
folder by a hash of every setting.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration

from ...cache import cache_dir, publish
from ..models.loading import quiet_transformers
from ..models.vision import VisionProcessor
from .shapes import COLOURS, IMAGE_SIZE, QUESTIONS, SHAPES, SHAPES_VERSION, SIDES, WARM_SEED, examples, scenes

#: Bumped whenever the model or the recipe changes meaning: part of the cache key.
WARM_START_VERSION = 2  # 2: a teacher that confuses each colour with its twin
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>", "<unk>")
#: Qwen2-VL's released chat template (its image part: <|vision_start|><|image_pad|><|vision_end|>;
#: a default system turn "You are a helpful assistant."), in one line per branch
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def words() -> list[str]:
    """The tokenizer's ordinary tokens: every word and mark of the template and the questions,
    the answers, a space and a newline."""
    text = " ".join(["system You are a helpful assistant . user Picture Video :", *QUESTIONS.values(),
                     *COLOURS, *SIDES, *SHAPES])
    out: list[str] = ["\n", " "]
    for w in text.split():
        if w not in out:
            out.append(w)
    return out


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer (a word, a mark, a space or a newline per token) with Qwen2-VL's
    special tokens (pad ``<|endoftext|>``, EOS ``<|im_end|>``) and chat template."""
    vocab = {t: i for i, t in enumerate((*SPECIAL, *words()))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<unk>", padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_image_processor() -> Any:
    from transformers import Qwen2VLImageProcessorPil
    pixels = IMAGE_SIZE * IMAGE_SIZE  # the task's pictures as they are: 4 x 4 patches, 4 image tokens
    return Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels,
                                    size={"shortest_edge": pixels, "longest_edge": pixels})


def model_config(tok: PreTrainedTokenizerFast) -> Qwen2VLConfig:
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                attention_dropout=0.0)
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


@dataclass(frozen=True)
class ShapesWarmStart:
    """Every setting of the warm start (all of it goes into the cache key)."""

    seed: int = 0
    train_scenes: int = 2000
    validation_scenes: int = 200
    batch_size: int = 32
    lr: float = 3e-3
    max_steps: int = 1500
    eval_every: int = 20
    confuse: float = 0.6  # the teacher names a colour's twin with this probability
    mode_target: float = 0.8  # learned the teacher: greedy == its most likely answer on this share
    settle_steps: int = 100  # then this many more steps, the learning rate decaying to 0


#: each colour's twin, which the warm start's teacher names instead with probability ``confuse``
TWINS = {"red": "orange", "orange": "red", "blue": "purple", "purple": "blue", "green": "yellow", "yellow": "green"}


def teacher_answer(ex: Any, confuse: float, rng: random.Random) -> str:
    """The flawed teacher's answer to a row: a colour's twin with probability ``confuse``."""
    if dict(ex.fields).get("question") == "colour" and rng.random() < confuse:
        return TWINS[ex.answer]
    return ex.answer


def teacher_mode(ex: Any, confuse: float) -> str:
    """The teacher's most likely answer to a row."""
    return TWINS[ex.answer] if dict(ex.fields).get("question") == "colour" and confuse > 0.5 else ex.answer


def warm_start_key(config: ShapesWarmStart) -> str:
    tok = build_tokenizer()
    blob = json.dumps({"version": WARM_START_VERSION, "task": SHAPES_VERSION, "model": model_config(tok).to_dict(),
                       "vocab": tok.get_vocab(), "warm_start": asdict(config)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _rows(processor: VisionProcessor, rows: Sequence[Any]) -> dict[str, torch.Tensor]:
    """Right-padded training rows (rendered prompt, answer, EOS) with their pictures' inputs and
    labels (-100 but on the answer and EOS tokens)."""
    tok = processor.tokenizer
    encoded = []
    for ex in rows:
        text = processor.render(ex.source)
        enc = processor.encode_refs(text, [p["image"] for p in ex.source[0]["content"] if p["type"] == "image"])
        target = tok(ex.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        encoded.append((enc, target))
    T = max(e["input_ids"].shape[1] + len(t) for e, t in encoded)
    N = len(encoded)
    ids = torch.full((N, T), tok.pad_token_id, dtype=torch.long)  # [N, T]
    mask = torch.zeros((N, T), dtype=torch.long)
    types = torch.zeros((N, T), dtype=torch.long)
    labels = torch.full((N, T), -100, dtype=torch.long)
    for i, (e, t) in enumerate(encoded):
        p = e["input_ids"].shape[1]
        ids[i, :p] = e["input_ids"][0]
        ids[i, p:p + len(t)] = torch.tensor(t)
        mask[i, :p + len(t)] = 1
        types[i, :p] = e["mm_token_type_ids"][0]
        labels[i, p:p + len(t)] = torch.tensor(t)
    return {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": types, "labels": labels,
            "pixel_values": torch.cat([e["pixel_values"] for e, _ in encoded]),
            "image_grid_thw": torch.cat([e["image_grid_thw"] for e, _ in encoded])}


@torch.no_grad()
def greedy_accuracy(model: Qwen2VLForConditionalGeneration, processor: VisionProcessor, rows: Sequence[Any],
                    batch_size: int = 100) -> float:
    """The fraction of ``rows`` whose greedy completion is exactly the answer then EOS: every
    answer token (and EOS) the argmax after the right ones before it, in one forward."""
    model.eval()
    right = 0
    for k in range(0, len(rows), batch_size):
        batch = _rows(processor, rows[k:k + batch_size])
        labels = batch.pop("labels")
        logits = model(**batch).logits[:, :-1]  # [N, T-1, V]
        target = labels[:, 1:]
        ok = (logits.argmax(-1) == target) | (target == -100)
        right += int(ok.all(-1).sum())
    return right / len(rows)


def _train(config: ShapesWarmStart, verbose: bool) -> tuple[Qwen2VLForConditionalGeneration, VisionProcessor, dict]:
    tok = build_tokenizer()
    processor = VisionProcessor(tok, build_image_processor(), 2)
    every = scenes(config.train_scenes + config.validation_scenes, WARM_SEED + config.seed, heldout=False)
    rows = examples(every)
    train, validation = rows[:config.train_scenes], rows[config.train_scenes:]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen2VLForConditionalGeneration(model_config(tok))
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.99), weight_decay=0.0)
    rng = random.Random(config.seed)
    modes = [replace(ex, answer=teacher_mode(ex, config.confuse)) for ex in validation]
    history: list[dict] = []
    t0 = time.perf_counter()
    accuracy, mode, step, end, reached = 0.0, 0.0, 0, config.max_steps, None
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: 1.0 if reached is None else max(0.0, 1.0 - (k - reached) / config.settle_steps))
    while step < end:
        model.train()
        batch = [replace(ex, answer=teacher_answer(ex, config.confuse, rng)) for ex in rng.sample(train, config.batch_size)]
        loss = model(**_rows(processor, batch)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if step % config.eval_every == 0 or step == end:
            accuracy = greedy_accuracy(model, processor, validation)
            mode = greedy_accuracy(model, processor, modes)
            history.append({"step": step, "loss": round(loss.item(), 4), "accuracy": accuracy, "teacher_mode": mode,
                            "seconds": round(time.perf_counter() - t0, 2)})
            if verbose:
                print("shapes warm start", history[-1], flush=True)
            if reached is None and mode >= config.mode_target:
                reached, end = step, min(config.max_steps, step + config.settle_steps)
    model.eval()
    report = {"settings": asdict(config), "version": WARM_START_VERSION, "steps": step,
              "seconds": round(time.perf_counter() - t0, 2), "validation_accuracy": accuracy,
              "validation_teacher_mode": mode, "reached_target_at": reached, "history": history}
    return model, processor, report


def warm_start(config: ShapesWarmStart | None = None, *, cache: str | os.PathLike | None = None,
               verbose: bool = False) -> Path:
    """The folder of the warm-started shapes model (weights, tokenizer with its chat template,
    ``preprocessor_config.json``, ``warm_start.json``), trained on a cache miss."""
    config = config if config is not None else ShapesWarmStart()
    root = (Path(cache) if cache is not None else cache_dir()) / "warm_start"
    target = root / f"shapes-{warm_start_key(config)}"
    if (target / "warm_start.json").is_file():
        return target
    model, processor, report = _train(config, verbose)

    def write(folder: Path) -> None:
        with quiet_transformers():
            model.save_pretrained(folder)
            processor.save_pretrained(folder)
        (folder / "warm_start.json").write_text(json.dumps(report, indent=2, default=str))
    return publish(target, write, done="warm_start.json")


def embedded_model() -> tuple[Path, str]:
    """(folder, label) of the shapes task's embedded model, warm-started on first use."""
    return warm_start(verbose=True), "embedded shapes vision-language model (warm-started)"

