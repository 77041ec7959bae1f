"""The evaluation sets: ``eval.data`` during a run and ``rldsl eval`` (run/eval_command.py): each
a data file (or reasoning-gym's generated rows, one set per task) with its reward (default: the
run's), read and rendered as training renders its prompts, and evaluated by the one evaluator
(run/evaluation.py: the metrics under ``eval/<set>/``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..config import EvalSetConfig, RunConfig
from ..data import reasoning_gym as rg
from ..data.datasets import Example, load_examples, render_prompt
from ..errors import ConfigError
from ..records.metrics import HELDOUT_TASKS
from ..rewards.functions import RewardFn
from ..rollout.engines.base import SamplingParams
from .evaluation import Generate, answer_set, scored_here, set_metrics


@dataclass
class EvalSet:
    """A named evaluation set: its prompts (rendered for the model) and the reward scoring it.
    ``own_reward``: scored by a reward other than the run's (the rollouts then only generate)."""

    name: str
    examples: list[Example]
    reward: RewardFn
    own_reward: bool = False


def set_name(path: str | Path, taken: Sequence[str] = ()) -> str:
    """A metric-friendly name for a set from its file name (``data/gsm8k_test.jsonl`` -> ``gsm8k_test``)."""
    p = Path(path)
    base = p.stem if p.suffix else p.name
    name = "".join(ch if ch.isalnum() or ch in "_-." else "_" for ch in base) or "set"
    out, i = name, 2
    while out in taken:
        out, i = f"{name}_{i}", i + 1
    return out


def evaluate_set(generate: Generate, s: EvalSet, cfg: RunConfig, *, n: int, seed: int,
                 episodes: bool = False) -> dict[str, float]:
    """The metrics of one set (module doc) under ``eval/<name>/``, its answers scored here: greedy,
    and ``n`` samples each as ``cfg`` samples an evaluation (``SamplingParams.for_evaluation``;
    none with ``n`` = 0). ``episodes``: ``generate`` runs multi-turn episodes (:func:`scored_here`)."""
    sampled = SamplingParams.for_evaluation(cfg, n, seed) if n >= 1 else None
    a = answer_set(scored_here(generate, s.reward, episodes), s.examples, max_new_tokens=cfg.max_new_tokens,
                   sampled=sampled)
    return set_metrics(s.name, a, s.reward)


def evaluate_sets(generate: Generate, sets: Sequence[EvalSet], cfg: RunConfig, **kwargs: Any) -> dict[str, float]:
    """Every set's metrics, one dict."""
    out: dict[str, float] = {}
    for s in sets:
        out.update(evaluate_set(generate, s, cfg, **kwargs))
    return out


# ----------------------------------------------------------------------------- reading a set

def load_eval_set(path: str | Path, reward: RewardFn, tokenizer: Any, *, prompt_key: str = "prompt",
                  answer_key: str | None = "answer", chat_template: str = "auto",
                  chat_template_kwargs: dict[str, Any] | None = None, system_prompt: str | None = None,
                  name: str | None = None, taken: Sequence[str] = (), image_key: str | None = None,
                  max_images: int = 8) -> EvalSet:
    """An evaluation set from a data file, its prompts rendered for ``tokenizer`` as training renders them."""
    examples = load_examples(path, prompt_field=prompt_key, answer_field=answer_key, image_field=image_key,
                             max_images=max_images)
    rendered = [render_prompt(e, tokenizer, mode=chat_template, kwargs=chat_template_kwargs,
                              system_prompt=system_prompt) for e in examples]
    return EvalSet(name or set_name(path, taken), rendered, reward)


def load_generated_sets(path: str, reward: RewardFn, tokenizer: Any, *, options: dict[str, Any], seed: int,
                        count: int | None, exclude: Sequence[str] = (), chat_template: str = "auto",
                        chat_template_kwargs: dict[str, Any] | None = None, system_prompt: str | None = None,
                        name: str | None = None, note: Callable[[str], None] | None = None) -> list[EvalSet]:
    """The evaluation sets of ``reasoning_gym:`` data: one set per task, a single task or a mix alike,
    named after the task (``eval/<task>/...``; with ``name``, ``eval/<name>/<task>/...``), rendered
    as training renders them."""
    by_task, line = rg.generate_eval(path, options, run_seed=seed, count=count, exclude=exclude)
    if note is not None:
        note(line)
    system_prompt = rg.row_system_prompt(path, system_prompt)
    sets: list[EvalSet] = []
    for task, rows in by_task.items():
        label = f"{name}/{task}" if name else task
        rendered = [render_prompt(e, tokenizer, mode=chat_template, kwargs=chat_template_kwargs,
                                  system_prompt=system_prompt) for e in rows]
        sets.append(EvalSet(label, rendered, reward))
    return sets


def eval_sets_of(cfg: RunConfig, tokenizer: Any, run_reward: RewardFn,
                 training: Sequence[str] = ()) -> list[EvalSet]:
    """The run's ``eval.data`` sets, read and rendered (a missing file or column fails here,
    before any model loads), each with its reward (the run's unless it names its own)."""
    d = cfg.data
    sets: list[EvalSet] = []
    for entry in cfg.eval.data:
        entry = EvalSetConfig(path=entry) if isinstance(entry, str) else entry
        own = entry.reward is not None and entry.reward != run_reward.spec
        reward = RewardFn(entry.reward, on_error=cfg.reward.on_error) if own else run_reward
        if rg.is_reasoning_gym(entry.path):
            options = dict(d.options) if entry.path == d.path else {}  # the training data's options
            new = load_generated_sets(entry.path, reward, tokenizer, options=options, seed=cfg.seed,
                                      count=None if d.eval_size is None else max(d.eval_size, 1),
                                      exclude=training, chat_template=d.chat_template,
                                      chat_template_kwargs=d.chat_template_kwargs,
                                      system_prompt=d.system_prompt, name=entry.name)
        else:
            new = [load_eval_set(entry.path, reward, tokenizer, prompt_key=d.prompt_key, answer_key=d.answer_key,
                                 chat_template=d.chat_template, chat_template_kwargs=d.chat_template_kwargs,
                                 system_prompt=d.system_prompt, name=entry.name, taken=taken(sets),
                                 image_key=d.image_key, max_images=d.max_images)]
        for s in new:
            s.own_reward = own
        add_sets(sets, new, "eval.data")
    return sets


#: The set name the held-out split's per-task metrics take (``eval/heldout/<task>/...``)
HELDOUT = HELDOUT_TASKS.removeprefix("eval/")


def taken(sets: Sequence[EvalSet]) -> list[str]:
    """The names a new set's file name may not become: the sets' and the held-out split's."""
    return [s.name for s in sets] + [HELDOUT]


def add_sets(sets: list[EvalSet], new: Sequence[EvalSet], where: str) -> None:
    """``sets`` += ``new``; a ConfigError when two sets would log under one name, or one under the
    held-out split's per-task metrics (``eval/heldout/...``)."""
    for s in new:
        if s.name in [x.name for x in sets]:
            raise ConfigError(f"{where}: two sets are named {s.name!r}; give them different names")
        if s.name.split("/")[0] == HELDOUT:
            raise ConfigError(f"{where}: the set {s.name!r} would log under {HELDOUT_TASKS}/, the held-out "
                              "split's per-task metrics; give it another name")
        sets.append(s)


def command_sets(paths: Sequence[str | Path], cfg: RunConfig, reward: RewardFn, tokenizer: Any,
                 note: Callable[[str], None] | None = None) -> list[EvalSet]:
    """``rldsl eval``'s sets: each path read and rendered as the run (``cfg``) renders its prompts;
    reasoning-gym data that is the run's own gets its options and none of its training questions."""
    d = cfg.data
    sets: list[EvalSet] = []
    for path in paths:
        if rg.is_reasoning_gym(str(path)):  # generated; the run's options when it is the run's data
            own = str(path) == d.path  # then none of the run's training questions either
            add_sets(sets, load_generated_sets(
                str(path), reward, tokenizer, options=dict(d.options) if own else {},
                seed=cfg.seed, count=d.eval_size,
                exclude=[e["question"] for e in rg.training_entries(d.path, d.options, run_seed=cfg.seed)]
                if own else (), chat_template=d.chat_template, chat_template_kwargs=d.chat_template_kwargs,
                system_prompt=d.system_prompt, note=note), "--data")
            continue
        add_sets(sets, [load_eval_set(path, reward, tokenizer, prompt_key=d.prompt_key,
                                      answer_key=d.answer_key, chat_template=d.chat_template,
                                      chat_template_kwargs=d.chat_template_kwargs,
                                      system_prompt=d.system_prompt, taken=taken(sets),
                                      image_key=d.image_key, max_images=d.max_images)], "--data")
    return sets
