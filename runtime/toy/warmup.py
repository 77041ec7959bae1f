"""The warm start: supervised training of the embedded model on the carry-dropping teacher's
answers, stopped once it has learned the teacher, cached by a hash of every setting.

The teacher drops each carry with probability 0.75, so the warm model adds without carrying
(held-out greedy accuracy ~0.27 whatever the seed) while sampling still finds the right sum
often enough that most groups of 8 have mixed rewards: RL has a real, explainable flaw to
fix. Why this recipe, and what it measured: docs/toy.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PretrainedConfig, PreTrainedTokenizerFast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ...cache import cache_dir, publish
from ..data.datasets import Example
from ..models.loading import quiet_transformers
from ..rollout.engines.base import SamplingParams
from ..rollout.engines.hf import HFEngine
from .model import CHARACTERS, build_tokenizer, tiny_config, vllm_variant_config
from .task import AdditionTask, carry_free_sum, teacher_answer

#: Bumped whenever the warm-start recipe changes meaning: it is part of the cache key.
WARM_START_VERSION = 2  # 2: split by unordered pair, stops on a validation slice of train pairs


@dataclass(frozen=True)
class WarmStartConfig:
    """Every setting of the warm start (all of it goes into the cache key)."""

    seed: int = 0
    drop_carry: float = 0.75
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 50
    max_steps: int = 3000
    eval_every: int = 50
    mode_target: float = 0.85
    settle_steps: int = 400
    task: AdditionTask = field(default_factory=AdditionTask)


def warm_start_key(config: WarmStartConfig, model_config: PretrainedConfig) -> str:
    """A short hash of the model config, the task, the warm-start settings and the version."""
    blob = json.dumps(
        {
            "version": WARM_START_VERSION,
            "model": model_config.to_dict(),
            "warm_start": asdict(config),
            "characters": CHARACTERS,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_start(
    config: WarmStartConfig | None = None,
    *,
    model_config: PretrainedConfig | None = None,
    cache: str | os.PathLike | None = None,
    verbose: bool = False,
) -> Path:
    """Return the folder of the warm-started toy model, training it on a cache miss.

    The folder holds ``save_pretrained`` output of the model and the tokenizer plus
    ``warm_start.json`` (settings, steps, seconds, validation accuracy). Loading:
    ``LlamaForCausalLM.from_pretrained(path)``, ``PreTrainedTokenizerFast.from_pretrained(path)``.
    ``model_config`` may be another causal LM's config on the toy's vocabulary (demos/moe.py's
    mixture-of-experts model): that model is trained the same way, under its own cache key.
    """
    config = config if config is not None else WarmStartConfig()
    tokenizer = build_tokenizer()
    model_config = model_config if model_config is not None else tiny_config(tokenizer)
    root = Path(cache) if cache is not None else cache_dir()
    target = root / "warm_start" / warm_start_key(config, model_config)
    if (target / "warm_start.json").is_file():
        return target

    model, report = _train_warm_start(config, model_config, tokenizer, verbose=verbose)

    def write(folder: Path) -> None:
        with quiet_transformers():  # no "Writing model shards" bar
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        (folder / "warm_start.json").write_text(json.dumps(report, indent=2, default=str))
    return publish(target, write, done="warm_start.json")


def embedded_model(vllm: bool) -> tuple[Path, str]:
    """(folder, label) of the addition task's embedded model, warm-started on first use; the
    head-dim-32 variant (``model.vllm_variant_config``) for vLLM."""
    if vllm:
        return (Path(warm_start(model_config=vllm_variant_config(), verbose=True)),
                "embedded toy model, head-dim-32 variant for vLLM (warm-started)")
    return Path(warm_start(verbose=True)), "embedded toy model (warm-started)"


def embedded_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer of the addition task's embedded model (its character vocabulary, model.py),
    built without warm-starting the model: what the task's prompts are written in."""
    return build_tokenizer()



def _answer_batch(
    tokenizer: PreTrainedTokenizerFast,
    pairs: list[tuple[int, int]],
    answers: list[str],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``<bos>a+b=<answer><eos>`` rows: (input_ids, attention_mask, labels), each [N, T].

    Labels are -100 except on the answer and EOS tokens.
    """
    vocab = tokenizer.get_vocab()
    rows, label_rows = [], []
    for (a, b), ans in zip(pairs, answers):
        prompt = [tokenizer.bos_token_id] + [vocab[c] for c in f"{a}+{b}="]
        target = [vocab[c] for c in ans] + [tokenizer.eos_token_id]
        rows.append(prompt + target)
        label_rows.append([-100] * len(prompt) + target)
    return padded_rows(rows, label_rows, tokenizer.pad_token_id)


def padded_rows(rows: list[list[int]], label_rows: list[list[int]], pad_id: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows right-padded to the longest: (input_ids, attention_mask, labels) [N, T], labels
    -100 past each row's own."""
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)  # [N, T]
    labels = torch.full((len(rows), T), -100, dtype=torch.long)  # [N, T]
    mask = torch.zeros((len(rows), T), dtype=torch.long)  # [N, T]
    for i, (row, lab) in enumerate(zip(rows, label_rows)):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(row)] = 1
    return ids, mask, labels


class WarmStartSchedule:
    """The optimizer and learning rate of the warm starts that train until the teacher's mode is
    learned (this module's and toy/basic_arithmetic.py's): AdamW (betas 0.9, 0.99, no weight
    decay); the rate warms up linearly over ``warmup_steps``, stays constant, and from the step
    the mode is learned (:meth:`learned`) decays linearly to 0 over ``settle_steps``."""

    def __init__(self, model: torch.nn.Module, *, lr: float, warmup_steps: int, settle_steps: int) -> None:
        self.warmup_steps, self.settle_steps = warmup_steps, settle_steps
        self.reached_at: int | None = None  # the step at which the teacher's mode was learned
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.factor)

    def factor(self, step: int) -> float:
        """The learning rate's factor at ``step``: warm-up, constant, then linear decay to 0."""
        if self.reached_at is not None:
            return max(0.0, 1.0 - (step - self.reached_at) / self.settle_steps)
        return min(1.0, (step + 1) / max(1, self.warmup_steps))

    def step(self, loss: torch.Tensor) -> None:
        """One supervised update on ``loss``."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()

    def learned(self, step: int, max_steps: int) -> int:
        """The teacher's mode is learned at ``step``: the rate decays from here; the step to end at."""
        self.reached_at = step
        return min(max_steps, step + self.settle_steps)


def _train_warm_start(
    config: WarmStartConfig,
    model_config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerFast,
    *,
    verbose: bool,
) -> tuple[torch.nn.Module, dict]:
    task = config.task
    # The stopping rule reads only the validation slice of the training pairs, which the
    # supervised steps never see; the held-out prompts are never read here.
    validation = task.validation_examples()
    valid_ids = {ex.id for ex in validation}
    train_pairs = [ab for i, ab in task.pairs(heldout=False) if i not in valid_ids]
    modes = [carry_free_sum(a, b) for _, (a, b) in task.validation_pairs()]
    if not validation:
        raise ValueError("the warm start needs a validation slice: AdditionTask.num_validation > 0")

    rng = random.Random(config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        # the toy's Llama, or another causal LM on the toy's vocabulary (demos/moe.py: a MoE)
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)](model_config)
    model.train()
    schedule = WarmStartSchedule(model, lr=config.lr, warmup_steps=config.warmup_steps,
                                 settle_steps=config.settle_steps)
    engine = HFEngine(model, tokenizer)
    t0 = time.perf_counter()
    history: list[dict] = []
    step = 0
    end = config.max_steps
    while step < end:
        pairs = [rng.choice(train_pairs) for _ in range(config.batch_size)]
        answers = [teacher_answer(a, b, drop_carry=config.drop_carry, rng=rng) for a, b in pairs]
        ids, mask, labels = _answer_batch(tokenizer, pairs, answers)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        schedule.step(loss)
        step += 1
        if step % config.eval_every == 0 or step == end:
            answers = greedy_answers(engine, [ex.prompt for ex in validation])
            model.train()
            accuracy = sum(a == ex.answer for a, ex in zip(answers, validation)) / len(validation)
            mode = sum(a == m for a, m in zip(answers, modes)) / len(validation)
            history.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "accuracy": accuracy,
                    "teacher_mode": mode,
                    "seconds": round(time.perf_counter() - t0, 2),
                }
            )
            if verbose:
                print("warm start", history[-1], flush=True)
            if schedule.reached_at is None and mode >= config.mode_target:
                end = schedule.learned(step, config.max_steps)
    model.eval()
    last = history[-1]
    reached_at = schedule.reached_at
    if reached_at is None:
        warnings.warn(
            f"toy warm start (seed {config.seed}) did not learn the teacher in {step} steps: "
            f"validation greedy accuracy {last['accuracy']:.3f}, teacher agreement "
            f"{last['teacher_mode']:.3f} < {config.mode_target}",
            stacklevel=3,
        )
    report = {
        "settings": asdict(config),
        "version": WARM_START_VERSION,
        "steps": step,
        "seconds": last["seconds"],
        "validation_accuracy": last["accuracy"],
        "validation_teacher_mode": last["teacher_mode"],
        "reached_target_at": reached_at,
        "history": history,
    }
    return model, report


def greedy_answers(engine: HFEngine, prompts: list[str], max_new_tokens: int = 4) -> list[str | None]:
    """Greedy completion of each prompt; None where no EOS came within ``max_new_tokens``."""
    batch = engine.generate(prompts, SamplingParams.greedy(max_new_tokens))
    return [c if f == "stop" else None for c, f in zip(batch.completions, batch.finish_reason)]


def evaluate_greedy(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, examples: list[Example]
) -> float:
    """Fraction of ``examples`` whose greedy completion is exactly the answer followed by EOS."""
    answers = greedy_answers(HFEngine(model, tokenizer), [ex.prompt for ex in examples])
    return sum(a == ex.answer for a, ex in zip(answers, examples)) / len(examples)


def load_warm_start(path: str | os.PathLike) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Load (model, tokenizer) from a ``warm_start`` folder, offline, in eval mode."""
    with quiet_transformers():  # no "Loading weights" bar
        model = LlamaForCausalLM.from_pretrained(path, local_files_only=True).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return model, tokenizer
