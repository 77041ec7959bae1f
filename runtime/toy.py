"""The embedded default: a character tokenizer, a 0.59M-parameter Llama and 2-digit addition.

``rldsl run`` with no ``--model`` trains this: small enough to learn in minutes on two
CPU cores, real enough that the RL loss, the masks and the weight sync all matter.

Task
    The prompt is ``"a+b="`` with a, b in [10, 99] (8100 pairs); the answer is the decimal
    sum. Reward 1 only for exactly the sum followed by EOS (``rewards.addition_reward``).
    A fixed set of 200 pairs (chosen by ``AdditionTask.heldout_seed``) is held out:
    training and the warm start never see them.

Warm start (``warm_start``)
    Supervised training on answers from a *carry-dropping teacher*: for every training
    sample the teacher writes the sum but drops each carry independently with
    probability ``drop_carry = 0.75`` (a dropped carry into the hundreds drops the leading
    "1"). The model learns the teacher's distribution: on a prompt with k carries the
    right answer has probability about 0.25**k. Greedy decoding picks the teacher's
    mode, the carry-free digit sum, so held-out greedy accuracy plateaus at the fraction
    of carry-free pairs (0.55 * 4/9 ~ 0.24 for operands in [10, 99]; 0.265 on the
    held-out set) *whatever the seed or the stopping step*, while sampling at temperature
    1 still finds the right answer on carry prompts (~17% of samples for one carry), so
    ~60% of groups of 8 have mixed rewards. RL then has a real, explainable flaw to fix
    (carrying), measured on held-out prompts. A clean teacher was rejected: its accuracy
    passes through 10-40% only for a few seconds at a seed-dependent step (TOY_STUDY.md).
    Operands in [0, 99] were rejected too: the variable digit alignment made the loss
    plateau 2-3x longer.

    Training: batch 32, AdamW (lr 1e-3, betas 0.9/0.99, weight decay 0), 50 linear
    warm-up steps, loss on the answer and EOS tokens only. Every ``eval_every`` steps the
    held-out prompts are decoded greedily; once ``mode_target`` of them get the teacher's
    mode (the model has learned the teacher: step ~400-550 depending on the seed), the
    learning rate decays linearly to 0 over ``settle_steps`` more steps, which sharpens
    the learned distribution, and training stops. Measured on 2 shared cores, 1 thread:
    850-950 steps, 20-36 s, held-out greedy accuracy 0.265 for seeds 0, 1, 2. If the
    target is not reached by ``max_steps`` a warning says so (and the report records it).

    The result (model + tokenizer, ``save_pretrained`` layout) is cached under
    ``cache_dir()/warm_start/<hash of every setting>``; later calls return at once.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .data import Example, PromptSource
from .engine import HFEngine
from .types import SamplingParams

#: Bumped whenever the warm-start recipe changes meaning: it is part of the cache key.
WARM_START_VERSION = 1

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = "0123456789+-*=,:() "


# --------------------------------------------------------------------------- tokenizer
def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, ``<bos>`` prepended, left padding, pad (0) != eos (2).

    Vocabulary (23 ids): ``<pad> <bos> <eos> <unk>`` then ``0-9 + - * = , : ( )`` and
    space. Any other character becomes ``<unk>``. Decoding fuses the characters back.
    """
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def tiny_config(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    hidden_size: int = 96,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    intermediate_size: int = 384,
    max_position_embeddings: int = 64,
) -> LlamaConfig:
    """The embedded model: a Llama with tied embeddings and no dropout (~0.59M params).

    The vocabulary and special ids come from ``tokenizer`` (``build_tokenizer()`` if None).
    """
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        attention_dropout=0.0,  # dropout must be 0: ratios must be exactly 1 on-policy
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )


# -------------------------------------------------------------------------------- task
@dataclass(frozen=True)
class AdditionTask:
    """``"a+b="`` -> ``str(a + b)`` for a, b in [low, high]; ``num_heldout`` pairs held out."""

    low: int = 10
    high: int = 99
    num_heldout: int = 200
    heldout_seed: int = 1234

    def __post_init__(self) -> None:
        n = (self.high - self.low + 1) ** 2
        if not 0 <= self.low <= self.high or not 0 < self.num_heldout < n:
            raise ValueError(f"bad AdditionTask {self}: need 0 <= low <= high and 0 < num_heldout < {n}")

    def pairs(self, heldout: bool) -> list[tuple[int, tuple[int, int]]]:
        """(id, (a, b)) of the training (or held-out) pairs; id = row-major index of the pair."""
        r = range(self.low, self.high + 1)
        every = [(a, b) for a in r for b in r]
        chosen = set(random.Random(self.heldout_seed).sample(range(len(every)), self.num_heldout))
        return [(i, ab) for i, ab in enumerate(every) if (i in chosen) == heldout]

    def _examples(self, heldout: bool) -> list[Example]:
        return [Example(id=i, prompt=f"{a}+{b}=", answer=str(a + b)) for i, (a, b) in self.pairs(heldout)]

    def train_examples(self) -> list[Example]:
        """Every pair not held out; ``Example.id`` = index of the pair in row-major order."""
        return self._examples(heldout=False)

    def heldout_examples(self) -> list[Example]:
        """The fixed held-out pairs (never trained on)."""
        return self._examples(heldout=True)

    def prompt_source(self, seed: int) -> PromptSource:
        """Training prompts as a ``PromptSource`` (shuffled per epoch from ``seed``)."""
        return PromptSource(self.train_examples(), seed=seed, name="toy-addition")


def carry_free_sum(a: int, b: int) -> str:
    """The digit-wise sum with every carry dropped, e.g. 58+67 -> "15" (the teacher's mode)."""
    return teacher_answer(a, b, drop_carry=1.0, rng=random.Random(0))


def teacher_answer(a: int, b: int, *, drop_carry: float, rng: random.Random) -> str:
    """Column addition of a + b where each carry is dropped with probability ``drop_carry``."""
    digits: list[int] = []
    carry = 0
    while a or b or carry:
        s = a % 10 + b % 10 + carry
        digits.append(s % 10)
        carry = s // 10 if rng.random() >= drop_carry else 0
        a, b = a // 10, b // 10
    return "".join(map(str, reversed(digits))) or "0"


# -------------------------------------------------------------------------- warm start
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


def cache_dir() -> Path:
    """``$RLDSL_CACHE``, else ``$XDG_CACHE_HOME/rldsl``, else ``~/.cache/rldsl``."""
    if os.environ.get("RLDSL_CACHE"):
        return Path(os.environ["RLDSL_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "rldsl"
    return Path.home() / ".cache" / "rldsl"


def warm_start_key(config: WarmStartConfig, model_config: LlamaConfig) -> str:
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
    model_config: LlamaConfig | None = None,
    cache: str | os.PathLike | None = None,
    verbose: bool = False,
) -> Path:
    """Return the folder of the warm-started toy model, training it on a cache miss.

    The folder holds ``save_pretrained`` output of the model and the tokenizer plus
    ``warm_start.json`` (settings, steps, seconds, held-out accuracy). Loading:
    ``LlamaForCausalLM.from_pretrained(path)``, ``PreTrainedTokenizerFast.from_pretrained(path)``.
    """
    config = config if config is not None else WarmStartConfig()
    tokenizer = build_tokenizer()
    model_config = model_config if model_config is not None else tiny_config(tokenizer)
    root = Path(cache) if cache is not None else cache_dir()
    target = root / "warm_start" / warm_start_key(config, model_config)
    if (target / "warm_start.json").is_file():
        return target

    model, report = _train_warm_start(config, model_config, tokenizer, verbose=verbose)
    root.joinpath("warm_start").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root / "warm_start"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "warm_start.json").write_text(json.dumps(report, indent=2, default=str))
        try:
            os.replace(tmp, target)
        except OSError:
            # another process finished first: keep its copy
            if not (target / "warm_start.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), tokenizer.pad_token_id, dtype=torch.long)  # [N, T]
    labels = torch.full((len(rows), T), -100, dtype=torch.long)  # [N, T]
    mask = torch.zeros((len(rows), T), dtype=torch.long)  # [N, T]
    for i, (row, lab) in enumerate(zip(rows, label_rows)):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(row)] = 1
    return ids, mask, labels


def _train_warm_start(
    config: WarmStartConfig,
    model_config: LlamaConfig,
    tokenizer: PreTrainedTokenizerFast,
    *,
    verbose: bool,
) -> tuple[LlamaForCausalLM, dict]:
    task = config.task
    train_pairs = [ab for _, ab in task.pairs(heldout=False)]
    heldout = task.heldout_examples()
    modes = [carry_free_sum(a, b) for _, (a, b) in task.pairs(heldout=True)]

    rng = random.Random(config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = LlamaForCausalLM(model_config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.99), weight_decay=0.0)
    reached_at: int | None = None  # step at which the teacher's mode was learned

    def lr_factor(step: int) -> float:  # warm-up, constant, then linear decay to 0
        if reached_at is not None:
            return max(0.0, 1.0 - (step - reached_at) / config.settle_steps)
        return min(1.0, (step + 1) / max(1, config.warmup_steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
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
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if step % config.eval_every == 0 or step == end:
            answers = greedy_answers(engine, [ex.prompt for ex in heldout])
            model.train()
            accuracy = sum(a == ex.answer for a, ex in zip(answers, heldout)) / len(heldout)
            mode = sum(a == m for a, m in zip(answers, modes)) / len(heldout)
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
            if reached_at is None and mode >= config.mode_target:
                reached_at = step
                end = min(config.max_steps, step + config.settle_steps)
    model.eval()
    last = history[-1]
    if reached_at is None:
        warnings.warn(
            f"toy warm start (seed {config.seed}) did not learn the teacher in {step} steps: "
            f"held-out greedy accuracy {last['accuracy']:.3f}, teacher agreement "
            f"{last['teacher_mode']:.3f} < {config.mode_target}",
            stacklevel=3,
        )
    report = {
        "settings": asdict(config),
        "version": WARM_START_VERSION,
        "steps": step,
        "seconds": last["seconds"],
        "heldout_accuracy": last["accuracy"],
        "heldout_teacher_mode": last["teacher_mode"],
        "reached_target_at": reached_at,
        "history": history,
    }
    return model, report


def greedy_answers(engine: HFEngine, prompts: list[str], max_new_tokens: int = 4) -> list[str | None]:
    """Greedy completion of each prompt; None where no EOS came within ``max_new_tokens``."""
    batch = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    return [c if f == "stop" else None for c, f in zip(batch.completions, batch.finish_reason)]


def evaluate_greedy(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, examples: list[Example]
) -> float:
    """Fraction of ``examples`` whose greedy completion is exactly the answer followed by EOS."""
    answers = greedy_answers(HFEngine(model, tokenizer), [ex.prompt for ex in examples])
    return sum(a == ex.answer for a, ex in zip(answers, examples)) / len(examples)


def load_warm_start(path: str | os.PathLike) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Load (model, tokenizer) from a ``warm_start`` folder, offline, in eval mode."""
    model = LlamaForCausalLM.from_pretrained(path, local_files_only=True).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return model, tokenizer
