"""``toy:arithmetic-chat``: a tiny model warm-started on tinker-cookbook's arithmetic recipe
(``math_rl.train env=arithmetic``) *as that recipe renders it*, so the recipe can learn on CPU
(docs/tinker.md "A CPU demo").

The prompts are made by the cookbook's own problem generator (``ArithmeticDataset``, batch
indices far past any a recipe run reads) and rendered by its own ``role_colon`` renderer (the
one it picks for ``Qwen/Qwen3-8B-Base``-like names): the few-shot ``User: ...\\n\\nAssistant:``
conversation. The answers (``teacher``) restate the problem as the embedded toy's task writes
it and then add in columns, `` 58+67=125\\n\\nUser:``, ending in the renderer's stop string (the
recipe grades the last integer), and the model starts from the toy's warm-started weights
(``from_toy``): it already adds two-digit numbers written ``a+b=``, which a model of this size
does not learn in minutes from the recipe's operands of 1 to 3 digits among 71 prompt tokens
(docs/tinker.md). The teacher drops each carry with probability ``drop_carry`` (the toy's
carry-dropping teacher, toy/task.py): the model writes the format nearly always and is right on
a minority of problems, so the recipe's reward has room to rise, by carrying.

The model is the embedded toy's Llama shape (toy/model.py) with 128 positions and its own
tokenizer: one token per character over printable ASCII *and* ``\\n`` (the toy's own tokenizer,
and so its warm-start cache, is left as it is). Every row starts with the same few-shot prefix,
so a training step runs that prefix once and shares its keys and values across the batch (the
same loss and gradient as running every row whole, under half the work). Cached like the
toy's warm start (``$RLDSL_CACHE``/``~/.cache/rldsl``), under its own key.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import string
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from ...cache import cache_dir, publish
from ..models.loading import quiet_transformers
from ..toy.model import build_tokenizer, tiny_config
from ..toy.task import carry_free_sum, teacher_answer
from ..toy.warmup import embedded_model

#: printable ASCII and "\n": every character the role_colon renderer and the questions use
CHAT_CHARACTERS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
#: Bumped whenever the recipe below changes meaning: part of the cache key.
VERSION = 3  # 3: its own tokenizer, from the toy's weights, the problem restated, a fixed number of steps
#: the cookbook's batch indices the warm start reads (a recipe run reads 0..n_batches-1)
FIRST_BATCH = 1_000_000
#: the longest answer, " 100+100=200\n\nUser:", in tokens: the demo samples this many
MAX_TOKENS = 20


@dataclass(frozen=True)
class ChatWarmStart:
    """Every setting of this warm start (all of it goes into the cache key)."""

    seed: int = 0
    drop_carry: float = 0.75
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 50
    steps: int = 600
    pool: int = 4000
    num_validation: int = 64
    eval_every: int = 150
    max_position_embeddings: int = 128


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """The toy's one-token-per-character tokenizer over ``CHAT_CHARACTERS``, split so that "\\n"
    is a token too (the toy's split, ``.``, skips it; the toy keeps its own)."""
    tokenizer = build_tokenizer(CHAT_CHARACTERS)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return tokenizer


def _renderer(tokenizer: PreTrainedTokenizerFast):
    """The cookbook's role_colon renderer (imported here: the cookbook is an optional install,
    docs/tinker.md)."""
    from tinker_cookbook import renderers
    return renderers.get_renderer("role_colon", tokenizer=tokenizer)


def recipe_problems(renderer, first: int, count: int) -> list[tuple[int, int, list[int]]]:
    """(x, y, rendered prompt tokens) of ``count`` problems from the cookbook's own generator and
    environment, batch indices ``first``, ``first + 1``, ..."""
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDataset

    dataset = ArithmeticDataset(batch_size=1, renderer=renderer, group_size=1, n_batches=first + count)
    out = []
    for index in range(first, first + count):
        env = dataset.get_batch(index)[0].env_thunk()
        prompt, _ = asyncio.run(env.initial_observation())
        out.append((env.x, env.y, prompt.to_ints()))
    return out


def teacher(x: int, y: int, drop_carry: float, rng: random.Random) -> str:
    """The warm start's answer to "What is x + y?": the problem restated as the toy's task writes
    it, two digits an operand (``05+59=``), then the toy's column sum that drops each carry with
    probability ``drop_carry`` (toy/task.py), e.g. `` 58+67=125`` or `` 58+67=115``; the recipe
    grades its last integer."""
    return f" {x:02d}+{y:02d}={teacher_answer(x, y, drop_carry=drop_carry, rng=rng)}"


def _key(config: ChatWarmStart, model_config, toy: Path) -> str:
    blob = json.dumps({"version": VERSION, "model": model_config.to_dict(), "settings": asdict(config),
                       "characters": CHAT_CHARACTERS, "toy": toy.name}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def arithmetic_chat_model(config: ChatWarmStart | None = None, *, cache: str | Path | None = None,
                          verbose: bool = False) -> Path:
    """The folder of the warm-started model (HF layout, ``warm_start.json``), trained on a miss."""
    config = config or ChatWarmStart()
    tokenizer = chat_tokenizer()
    model_config = tiny_config(tokenizer, max_position_embeddings=config.max_position_embeddings)
    toy = embedded_model(vllm=False)[0]
    root = Path(cache) if cache is not None else cache_dir()
    target = root / "warm_start" / f"chat-{_key(config, model_config, toy)}"
    if (target / "warm_start.json").is_file():
        return target
    model, report = _train(config, model_config, tokenizer, toy, verbose)

    def write(folder: Path) -> None:
        with quiet_transformers():
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        (folder / "warm_start.json").write_text(json.dumps(report, indent=2))
    return publish(target, write, done="warm_start.json")


def _split(problems: list[tuple[int, int, list[int]]]) -> int:
    """How many leading tokens every rendered prompt shares (the few-shot turn and ``What is ``)."""
    first = problems[0][2]
    return min(next((i for i, t in enumerate(first[:len(p)]) if p[i] != t), min(len(p), len(first)))
               for _, _, p in problems)


def shared_prefix_loss(model, prefix: list[int], rows: list[list[int]], labels: list[list[int]], pad_id: int):
    """Mean cross-entropy on the labelled tokens of ``prefix + row`` for every row, the prefix run
    once and its keys and values repeated across the batch (right padding: no row sees a pad)."""
    n, width = len(rows), max(map(len, rows))
    ids = torch.full((n, width), pad_id, dtype=torch.long)  # [N, T]
    lab = torch.full((n, width), -100, dtype=torch.long)  # [N, T]
    for i, (row, label) in enumerate(zip(rows, labels)):
        ids[i, :len(row)] = torch.tensor(row)
        lab[i, :len(label)] = torch.tensor(label)
    cache = model(input_ids=torch.tensor([prefix]), use_cache=True).cache
    cache.batch_repeat_interleave(n)
    logits = model(input_ids=ids, cache=cache).logits  # [N, T, V]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), lab[:, 1:].reshape(-1),
                                             ignore_index=-100)


def final_int(text: str) -> int | None:
    """The last integer of an answer, commas ignored: what the recipe grades (``ArithmeticEnv``)."""
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return int(found[-1]) if found else None


def _answers(model, tokenizer, prompts: list[list[int]], stop: str, sample: bool, seed: int) -> list[str | None]:
    """The answer before ``stop`` of one continuation per prompt (None: no stop string in
    ``MAX_TOKENS``), greedy or sampled at temperature 1 as the recipe samples."""
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [N, T] left-padded
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(ids, attention_mask=(ids != pad).long(), max_new_tokens=MAX_TOKENS, do_sample=sample,
                             temperature=1.0 if sample else None, top_k=0 if sample else None, top_p=None,
                             pad_token_id=pad)
    texts = [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out]
    return [t.split(stop)[0].strip() if stop in t else None for t in texts]


def evaluate(model, tokenizer, problems: list[tuple[int, int, list[int]]], stop: str) -> dict:
    """Greedy and sampled accuracy and format rate on ``problems``, and a few greedy answers."""
    model.eval()
    report = {}
    for name, sample in (("greedy", False), ("sampled", True)):
        said = _answers(model, tokenizer, [p for _, _, p in problems], stop, sample, seed=0)
        report[f"{name}_correct"] = sum(s is not None and final_int(s) == x + y
                                        for s, (x, y, _) in zip(said, problems)) / len(problems)
        report[f"{name}_format"] = sum(s is not None for s in said) / len(problems)
        report[f"{name}_carry_free"] = sum(s is not None and final_int(s) == int(carry_free_sum(x, y)) != x + y
                                           for s, (x, y, _) in zip(said, problems)) / len(problems)
        if not sample:
            report["examples"] = [f"{x} + {y} -> {s!r}" for s, (x, y, _) in zip(said[:10], problems)]
    return report


def from_toy(model_config, tokenizer: PreTrainedTokenizerFast, toy: Path) -> LlamaForCausalLM:
    """The chat model with the warm-started toy's weights (toy/warmup.py: it already adds two-digit
    numbers written ``a+b=``): every layer as it is, the embedding rows of the toy's characters
    copied to the same characters' rows here, the other characters' rows as initialised."""
    with quiet_transformers():
        source = LlamaForCausalLM.from_pretrained(toy)
    weights = source.state_dict()
    embedding = weights.pop("model.embed_tokens.weight")  # [toy vocab, hidden]
    weights.pop("lm_head.weight", None)  # tied to the embedding
    model = LlamaForCausalLM(model_config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"model.embed_tokens.weight", "lm_head.weight"}:
        raise RuntimeError(f"the toy's weights do not fit the chat model: {missing} {unexpected}")
    ours = tokenizer.get_vocab()
    with torch.no_grad():
        rows = model.get_input_embeddings().weight
        for token, index in build_tokenizer().get_vocab().items():
            rows[ours[token]] = embedding[index]
    return model


def _train(config: ChatWarmStart, model_config, tokenizer, toy: Path, verbose: bool) -> tuple[LlamaForCausalLM, dict]:
    renderer = _renderer(tokenizer)
    stop = renderer.get_stop_sequences()[0]  # "\n\nUser:"
    if tokenizer.unk_token_id in tokenizer.encode(stop, add_special_tokens=False):
        raise RuntimeError(f"the chat tokenizer cannot write the renderer's stop string {stop!r}: "
                           "its answers could never stop")
    validation = recipe_problems(renderer, FIRST_BATCH, config.num_validation)
    pool = recipe_problems(renderer, FIRST_BATCH + config.num_validation, config.pool)
    cut = _split(pool)
    prefix = pool[0][2][:cut]
    rng = random.Random(config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = from_toy(model_config, tokenizer, toy)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.99), weight_decay=0.0)
    # warm-up, then linear decay to 0 at the last step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / config.warmup_steps,
                                                                 (config.steps - s) / config.steps))
    t0, losses, history = time.perf_counter(), [], []
    for step in range(1, config.steps + 1):
        rows, labels = [], []
        for x, y, prompt in (rng.choice(pool) for _ in range(config.batch_size)):
            answer = tokenizer.encode(teacher(x, y, config.drop_carry, rng) + stop, add_special_tokens=False)
            rows.append(prompt[cut:] + answer)
            labels.append([-100] * (len(prompt) - cut) + answer)
        loss = shared_prefix_loss(model, prefix, rows, labels, tokenizer.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % config.eval_every == 0 or step == config.steps:
            report = evaluate(model, tokenizer, validation, stop)
            model.train()
            history.append({"step": step, "loss": round(sum(losses[-100:]) / len(losses[-100:]), 4),
                            "seconds": round(time.perf_counter() - t0, 1),
                            **{k: v for k, v in report.items() if k != "examples"}})
            if verbose:
                print("arithmetic-chat warm start:", history[-1], flush=True)
    model.eval()
    return model, {"settings": asdict(config), "version": VERSION, "seconds": history[-1]["seconds"],
                   "validation": history[-1], "examples": report["examples"], "history": history}
