"""The second embedded demo: the toy model's shape over printable text, warm-started on
reasoning-gym's ``basic_arithmetic`` task (two terms of 0-100, ``+``) by a teacher with
systematic mistakes (docs/reasoning_gym.md).

The prompt is reasoning-gym's question as it is ("Calculate 58 + 7."); the answer is written
alone (``reward.answer_format = "plain"``) or in reasoning-gym's tag (``<answer>65</answer>``).
The teacher drops each carry, and writes a shorter number under the left end of the longer one
(``58 + 7`` as ``58 + 70``), each with probability ``drop = 0.75``: the warm model's greedy
answer is the teacher's mode, right on ~1/5 of the problems, while sampling still finds the
right answer often enough for RL to learn it. (The teacher also writes differences, dropping
borrows and a negative result's sign; the demo does not use them: docs/reasoning_gym.md.) The
reward is reasoning-gym's own ``score_answer``.

Cached like the toy (``toy.cache_dir()``/``warm_start/basic_arithmetic-<hash>``), keyed by every setting.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ..data.reasoning_gym import PREFIX, parse_tasks, read_options, training_entries
from ..errors import RunError
from ..rollout.engines.base import SamplingParams
from ..rollout.engines.hf import HFEngine
from .model import build_tokenizer, tiny_config
from ...cache import cache_dir, publish
from .warmup import WarmStartSchedule, padded_rows

#: One token per character of printable ASCII and the newline (reasoning-gym's questions and
#: answers of the arithmetic tasks are ASCII; anything else becomes <unk>).
PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n"
#: Bumped whenever the recipe changes meaning: part of the cache key.
ARITHMETIC_WARM_START_VERSION = 2  # 2: the alignment mistake
TASK = "basic_arithmetic"


def arithmetic_tokenizer() -> PreTrainedTokenizerFast:
    """The toy tokenizer over :data:`PRINTABLE` (100 ids)."""
    return build_tokenizer(PRINTABLE)


def arithmetic_model_config(tokenizer: PreTrainedTokenizerFast | None = None) -> LlamaConfig:
    """The toy's shape (hidden 96, 4 layers, 4 heads) with a context of 64 characters: the
    question is ~18, the tagged answer ~20."""
    return tiny_config(tokenizer if tokenizer is not None else arithmetic_tokenizer(),
                       max_position_embeddings=64)


def written(answer: str, answer_format: str) -> str:
    """The answer as the model writes it: in reasoning-gym's tag (``<answer>...</answer>``), or
    alone (``plain``)."""
    return f"<answer>{answer}</answer>" if answer_format == "tag" else answer


def _column(a: int, b: int, sign: int, drop: float, rng: random.Random) -> int:
    """a + b (sign 1) or a - b (sign -1, a >= b) column by column, each carry or borrow dropped
    with probability ``drop``."""
    digits, carry, place = 0, 0, 1
    while a or b or carry:
        s = a % 10 + sign * (b % 10) + carry
        digit, carry = s % 10, (s // 10 if s >= 0 else -1)
        if carry and rng.random() < drop:
            carry = 0
        digits += digit * place
        place *= 10
        a, b = a // 10, b // 10
    return digits


def teacher_answer(expression: str, *, drop: float, rng: random.Random) -> str:
    """The teacher's answer to a two-term sum ``"a + b"`` / ``"a - b"``: each carry or
    borrow dropped with probability ``drop``, and a negative result's minus sign too; in a sum of
    numbers of different lengths the shorter one is written under the left end of the longer one
    (``58 + 7`` as ``58 + 70``) with probability ``drop``."""
    left, op, right = expression.split()
    a, b = int(left), int(right)
    if op == "+":
        if len(left) != len(right) and rng.random() < drop:  # the shorter number aligned left
            shift = 10 ** abs(len(left) - len(right))
            a, b = (a * shift, b) if len(left) < len(right) else (a, b * shift)
        return str(_column(a, b, 1, drop, rng))
    if a >= b:
        return str(_column(a, b, -1, drop, rng))
    magnitude = _column(b, a, -1, drop, rng)
    return str(magnitude) if rng.random() < drop else f"-{magnitude}"


def teacher_mode(expression: str) -> str:
    """The teacher's most likely answer: every carry, borrow and sign dropped."""
    return teacher_answer(expression, drop=1.0, rng=random.Random(0))


@dataclass(frozen=True)
class ArithmeticWarmStart:
    """Every setting of the warm start (all of it is in the cache key).

    ``options``, ``size`` and ``data_seed`` name the training set exactly as the run generates
    it (``reasoning_gym.create_dataset(TASK, size=, seed=, **options)``): the warm start trains
    on those questions only (so never on a held-out one), less a ``num_validation`` slice it
    stops on.
    """

    options: tuple[tuple[str, Any], ...] = (("allow_parentheses", False), ("max_digits", 2), ("max_terms", 2),
                                            ("min_digits", 2), ("min_terms", 2),
                                            ("operators", ("+",)))  # sorted by key
    size: int = 4000
    data_seed: int = 0
    seed: int = 0
    drop: float = 0.75
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 50
    max_steps: int = 4000
    eval_every: int = 100
    answer_format: str = "plain"  # "tag": <answer>...</answer>; "plain": the answer alone (reward.answer_format)
    num_validation: int = 200
    mode_target: float = 0.85
    settle_steps: int = 400


def entries(settings: ArithmeticWarmStart) -> list[dict]:
    """The run's training entries of these settings (``reasoning_gym.training_entries``)."""
    options = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.options}
    return training_entries(PREFIX + TASK, {**options, "size": settings.size, "seed": settings.data_seed},
                            run_seed=settings.data_seed)


def warm_start_key(settings: ArithmeticWarmStart, model_config: LlamaConfig) -> str:
    blob = json.dumps({"version": ARITHMETIC_WARM_START_VERSION, "task": TASK, "model": model_config.to_dict(),
                       "warm_start": asdict(settings),
                       "characters": PRINTABLE}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def arithmetic_warm_start(settings: ArithmeticWarmStart | None = None, *, cache: str | os.PathLike | None = None,
                         verbose: bool = False) -> Path:
    """The folder of the warm-started arithmetic model (``save_pretrained`` layout plus
    ``warm_start.json``), trained on a cache miss."""
    settings = settings if settings is not None else ArithmeticWarmStart()
    tokenizer = arithmetic_tokenizer()
    model_config = arithmetic_model_config(tokenizer)
    root = Path(cache) if cache is not None else cache_dir()
    target = root / "warm_start" / f"{TASK}-{warm_start_key(settings, model_config)}"
    if (target / "warm_start.json").is_file():
        return target
    model, report = _train(settings, model_config, tokenizer, verbose=verbose)

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "warm_start.json").write_text(json.dumps(report, indent=2, default=str))
    return publish(target, write, done="warm_start.json")


def _rows(tokenizer: PreTrainedTokenizerFast, prompts: list[str], targets: list[str]
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``<bos>prompt target<eos>`` rows: (input_ids, attention_mask, labels) [N, T],
    labels -100 except on the target and EOS."""
    rows, label_rows = [], []
    for p, t in zip(prompts, targets):
        prompt = tokenizer(p)["input_ids"]  # <bos> + one id per character
        target = tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + target)
        label_rows.append([-100] * len(prompt) + target)
    return padded_rows(rows, label_rows, tokenizer.pad_token_id)


def greedy(engine: HFEngine, prompts: list[str], max_new_tokens: int = 24) -> list[str | None]:
    """Greedy completions; None where no EOS came within ``max_new_tokens``."""
    batch = engine.generate(prompts, SamplingParams.greedy(max_new_tokens))
    return [c if f == "stop" else None for c, f in zip(batch.completions, batch.finish_reason)]


def _train(settings: ArithmeticWarmStart, model_config: LlamaConfig, tokenizer: PreTrainedTokenizerFast,
           *, verbose: bool) -> tuple[LlamaForCausalLM, dict]:
    rows = entries(settings)
    by_question: dict[str, dict] = {}
    for e in rows:
        by_question.setdefault(e["question"], e)
    unique = list(by_question.values())
    random.Random(settings.seed).shuffle(unique)
    validation, train = unique[: settings.num_validation], unique[settings.num_validation:]
    if not validation or not train:
        raise ValueError(f"arithmetic warm start: {len(unique)} distinct questions leave no validation "
                         f"({settings.num_validation}) or training slice")
    val_prompts = [e["question"] for e in validation]
    fmt = settings.answer_format
    val_right = [written(e["answer"], fmt) for e in validation]
    val_modes = [written(teacher_mode(e["metadata"]["expression"]), fmt) for e in validation]

    rng = random.Random(settings.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        model = LlamaForCausalLM(model_config)
    model.train()
    schedule = WarmStartSchedule(model, lr=settings.lr, warmup_steps=settings.warmup_steps,
                                 settle_steps=settings.settle_steps)
    engine = HFEngine(model, tokenizer)
    t0 = time.perf_counter()
    history: list[dict] = []
    step, end = 0, settings.max_steps
    while step < end:
        batch = [rng.choice(train) for _ in range(settings.batch_size)]
        targets = [written(teacher_answer(e["metadata"]["expression"], drop=settings.drop, rng=rng), fmt)
                   for e in batch]
        ids, mask, labels = _rows(tokenizer, [e["question"] for e in batch], targets)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        schedule.step(loss)
        step += 1
        if step % settings.eval_every == 0 or step == end:
            answers = greedy(engine, val_prompts)
            model.train()
            n = len(validation)
            history.append({"step": step, "loss": round(loss.item(), 4),
                            "accuracy": sum(a == r for a, r in zip(answers, val_right)) / n,
                            "teacher_mode": sum(a == m for a, m in zip(answers, val_modes)) / n,
                            "seconds": round(time.perf_counter() - t0, 2)})
            if verbose:
                print("arithmetic warm start", history[-1], flush=True)
            if schedule.reached_at is None and history[-1]["teacher_mode"] >= settings.mode_target:
                end = schedule.learned(step, settings.max_steps)
    model.eval()
    last = history[-1]
    reached_at = schedule.reached_at
    if reached_at is None:
        warnings.warn(f"arithmetic warm start (seed {settings.seed}) did not learn the teacher in {step} steps: "
                      f"teacher agreement {last['teacher_mode']:.3f} < {settings.mode_target}", stacklevel=3)
    report = {"settings": asdict(settings), "version": ARITHMETIC_WARM_START_VERSION, "steps": step,
              "seconds": last["seconds"], "validation_accuracy": last["accuracy"],
              "validation_teacher_mode": last["teacher_mode"], "reached_target_at": reached_at,
              "history": history}
    return model, report


def embedded_model(path: str, options: dict[str, Any], run_seed: int, answer_format: str = "tag", *,
                   verbose: bool = False) -> Path:
    """The warm-started model for ``data.path`` / ``data.options`` when no ``model.path`` is set:
    reasoning-gym's ``basic_arithmetic`` with two terms, + and - (any digits), trained on that run's training set."""
    tasks = parse_tasks(path)
    names = [n for n, _ in tasks]
    opts = read_options(options, names, run_seed)
    task_opts = opts.per_task.get(TASK, {})
    if names != [TASK] or task_opts.get("min_terms") != 2 or task_opts.get("max_terms") != 2 \
            or task_opts.get("allow_parentheses", True) or not set(task_opts.get("operators", "*")) <= {"+", "-"}:
        raise RunError(f"no embedded model for {path} with options {dict(options)}: the embedded one is "
                       f"warm-started for reasoning_gym:{TASK} with min_terms = max_terms = 2, operators "
                       "+ and -, allow_parentheses = false (docs/reasoning_gym.md); set model.path to "
                       "train another task")
    frozen = {k: tuple(v) if isinstance(v, list) else v for k, v in task_opts.items()}
    settings = ArithmeticWarmStart(options=tuple(sorted(frozen.items())), size=opts.size, data_seed=opts.seed,
                                   answer_format=answer_format)
    return arithmetic_warm_start(settings, verbose=verbose)
