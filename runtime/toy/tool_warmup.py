"""The tool-use demo's warm start: supervised training on the teacher's conversations
(calculator.teacher_trace), which teaches the call FORMAT, not its right use: the teacher
calls the calculator in well-formed Hermes calls whose expression is mostly wrong (a dropped
term, swapped digits) and often answers with the carry-free sum instead of the tool's
result; sometimes it answers directly. RL has to learn to call with the whole sum and copy
the result (docs/tool_use.md). Cached like warmup.py, by a hash of every setting.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ..models.loading import quiet_transformers
from .calculator import SumTask, TeacherMix, calculator, teacher_trace
from .tool_model import CHAT_TEMPLATE, HERMES_TOKENS, TOOL_CHARACTERS, build_tool_tokenizer, tool_model_config
from ...cache import cache_dir

#: Bumped whenever the recipe changes meaning: it is part of the cache key.
TOOL_WARM_START_VERSION = 1


@dataclass(frozen=True)
class ToolWarmStartConfig:
    """Every setting of the tool warm start (all of it goes into the cache key)."""

    seed: int = 0
    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 50
    mix: TeacherMix = field(default_factory=TeacherMix)
    task: SumTask = field(default_factory=SumTask)


def tool_warm_start_key(config: ToolWarmStartConfig, model_config: LlamaConfig) -> str:
    """A short hash of the model config, the tokenizer and template, the settings and the version."""
    blob = json.dumps({"version": TOOL_WARM_START_VERSION, "model": model_config.to_dict(),
                       "warm_start": asdict(config), "characters": TOOL_CHARACTERS,
                       "tokens": HERMES_TOKENS, "template": CHAT_TEMPLATE}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def conversation_tokens(tokenizer: PreTrainedTokenizerFast, messages: list[dict],
                        tools: list[Any] | None) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a conversation as the chat template renders it, ending with the last
    assistant message's EOS; the mask is 1 on the assistant messages' tokens and their EOS --
    the tokens the model would have sampled in an episode."""
    ids: list[int] = []
    mask: list[int] = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        text = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False,
                                             add_generation_prompt=True)
        prefix = tokenizer(text, add_special_tokens=False)["input_ids"]
        if prefix[: len(ids)] != ids:
            raise AssertionError("the chat template re-rendered an earlier turn differently")
        mask += [0] * (len(prefix) - len(ids))
        ids = list(prefix)
        body = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids += body
        mask += [1] * len(body)
    return ids, mask


def teacher_batch(tokenizer: PreTrainedTokenizerFast, rows: list[tuple[int, ...]], mix: TeacherMix,
                  rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded teacher conversations: (input_ids, attention_mask, labels), each [N, T];
    labels are -100 off the assistant tokens."""
    seqs = []
    for numbers in rows:
        messages = [{"role": "user", "content": SumTask.prompt(numbers)}, *teacher_trace(numbers, mix, rng)]
        seqs.append(conversation_tokens(tokenizer, messages, [calculator]))
    T = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), T), tokenizer.pad_token_id, dtype=torch.long)  # [N, T]
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)  # [N, T]
    attention = torch.zeros((len(seqs), T), dtype=torch.long)  # [N, T]
    for i, (s, m) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
        labels[i, : len(s)] = torch.where(torch.tensor(m) == 1, torch.tensor(s), -100)
    return ids, attention, labels


def tool_warm_start(config: ToolWarmStartConfig | None = None, *, model_config: LlamaConfig | None = None,
                    cache: str | os.PathLike | None = None, verbose: bool = False) -> Path:
    """Return the folder of the warm-started tool model (model + tokenizer with its chat
    template + ``warm_start.json``), training it on a cache miss."""
    config = config if config is not None else ToolWarmStartConfig()
    tokenizer = build_tool_tokenizer()
    model_config = model_config if model_config is not None else tool_model_config(tokenizer)
    root = Path(cache) if cache is not None else cache_dir()
    target = root / "tool_warm_start" / tool_warm_start_key(config, model_config)
    if (target / "warm_start.json").is_file():
        return target
    model, report = _train(config, model_config, tokenizer, verbose=verbose)
    (root / "tool_warm_start").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root / "tool_warm_start"))
    try:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        with quiet_transformers():  # no "Writing model shards" bar
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        (tmp / "warm_start.json").write_text(json.dumps(report, indent=2, default=str))
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "warm_start.json").is_file():  # another process finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def embedded_model(vllm: bool) -> tuple[Path, str]:
    """(folder, label) of the calculator task's embedded model, warm-started on first use; for
    vLLM the variant of head dim 32, as the toy's."""
    if vllm:
        return (Path(tool_warm_start(model_config=tool_model_config(num_attention_heads=3), verbose=True)),
                "embedded tool-use model, head-dim-32 variant for vLLM (warm-started)")
    return Path(tool_warm_start(verbose=True)), "embedded tool-use model (warm-started)"


def embedded_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer of the calculator task's embedded model (tool_model.py: characters and the
    Hermes tool-call tokens), built without warm-starting the model."""
    return build_tool_tokenizer()



def _train(config: ToolWarmStartConfig, model_config: LlamaConfig, tokenizer: PreTrainedTokenizerFast,
           *, verbose: bool) -> tuple[LlamaForCausalLM, dict]:
    task = config.task
    valid = {ex.prompt for ex in task.validation_examples()}
    rows = [tuple(int(x) for x in ex.prompt[:-1].split("+")) for ex in task.train_examples()
            if ex.prompt not in valid]  # the held-out prompts are never read here
    rng = random.Random(config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = LlamaForCausalLM(model_config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / config.warmup_steps,
                                                                 max(0.0, 1 - s / config.steps)))
    t0 = time.perf_counter()
    history: list[dict] = []
    for step in range(1, config.steps + 1):
        ids, attention, labels = teacher_batch(tokenizer, [rng.choice(rows) for _ in range(config.batch_size)],
                                               config.mix, rng)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == config.steps:
            history.append({"step": step, "loss": round(loss.item(), 4),
                            "seconds": round(time.perf_counter() - t0, 2)})
            if verbose:
                print("tool warm start", history[-1], flush=True)
    model.eval()
    report = {"settings": asdict(config), "version": TOOL_WARM_START_VERSION, "steps": config.steps,
              "seconds": history[-1]["seconds"], "history": history}
    return model, report
