"""The evaluation sets: ``eval.data`` during a run and ``rldsl eval`` (run/eval_command.py): each
a data file (or reasoning-gym's generated rows, one set per task), read by its prompt source
(data/sources.py), with its reward (default: the run's), rendered as training renders its
prompts, and evaluated by the one evaluator (run/evaluation.py: the metrics under ``eval/<set>/``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..config import EvalSetConfig, RunConfig
from ..data.datasets import Example, render_prompt
from ..data.sources import Source, default_reward, eval_source, system_prompt
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
    system_prompt: str | None = None  # what its prompts are rendered with (:func:`render_set`)


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
                 multi_turn: bool = False) -> dict[str, float]:
    """The metrics of one set (module doc) under ``eval/<name>/``, its answers scored here: greedy,
    and ``n`` samples each as ``cfg`` samples an evaluation (``SamplingParams.for_evaluation``;
    none with ``n`` = 0). ``multi_turn``: ``generate`` runs multi-turn episodes (:func:`scored_here`)."""
    sampled = SamplingParams.for_evaluation(cfg, n, seed) if n >= 1 else None
    a = answer_set(scored_here(generate, s.reward, multi_turn), s.examples, max_new_tokens=cfg.max_new_tokens,
                   sampled=sampled)
    return set_metrics(s.name, a, s.reward)


def evaluate_sets(generate: Generate, sets: Sequence[EvalSet], cfg: RunConfig, **kwargs: Any) -> dict[str, float]:
    """Every set's metrics, one dict."""
    out: dict[str, float] = {}
    for s in sets:
        out.update(evaluate_set(generate, s, cfg, **kwargs))
    return out


# ----------------------------------------------------------------------------- reading a set

def read_sets(path: str | Path, cfg: RunConfig, reward: RewardFn, *, count: int | None = None,
              exclude: Sequence[str] | None = None, name: str | None = None, taken: Sequence[str] = (),
              note: Callable[[str], None] | None = None) -> list[EvalSet]:
    """The evaluation sets of ``path`` as read, not yet rendered (:func:`render_set`), by its
    prompt source (data/sources.py ``eval_rows``: a data file is one set named after the file,
    ``reasoning_gym:`` data one set per task named after the task, a single task or a mix alike;
    with ``name``: ``name``, ``name/<task>``), each with the rows' system prompt
    (``system_prompt``). Needs no tokenizer: a missing file or column fails before one loads.
    ``count``, ``exclude``: the source's (:class:`~rldsl.runtime.data.sources.Source`)."""
    source = eval_source(cfg, path)
    by_set, line = source.eval_rows(cfg, str(path), count, exclude)
    if note is not None and line:
        note(line)
    system = system_prompt(cfg, source=source)
    return [EvalSet((f"{name}/{label}" if name else label) if label else (name or set_name(path, taken)),
                    rows, reward, system_prompt=system) for label, rows in by_set.items()]


def render_set(s: EvalSet, cfg: RunConfig, tokenizer: Any) -> EvalSet:
    """``s`` with its prompts rendered as training renders its prompts (chat template, system prompt)."""
    d = cfg.data
    rendered = [render_prompt(e, tokenizer, mode=d.chat_template, kwargs=d.chat_template_kwargs,
                              system_prompt=s.system_prompt) for e in s.examples]
    return replace(s, examples=rendered)


def load_sets(path: str | Path, cfg: RunConfig, reward: RewardFn, tokenizer: Any, **kwargs: Any) -> list[EvalSet]:
    """The evaluation sets of ``path`` read (:func:`read_sets`, its keywords) and rendered."""
    return [render_set(s, cfg, tokenizer) for s in read_sets(path, cfg, reward, **kwargs)]


def eval_rows_of(cfg: RunConfig, source: Source, run_reward: RewardFn, training: Sequence[str] = ()) -> list[EvalSet]:
    """The run's ``eval.data`` sets as read, not yet rendered (a missing file or column fails here,
    before the tokenizer or any model loads), each with its reward (the run's unless it names its
    own). ``source``: the run's (bound by the plan); ``training``: the run's training questions,
    which no generated set holds."""
    d = cfg.data
    sets: list[EvalSet] = []
    # the held-out split's per-task metrics take eval/heldout/ when the source has tasks
    reserved = [HELDOUT] if source.has_tasks else []
    for entry in cfg.eval.data:
        entry = EvalSetConfig(path=entry) if isinstance(entry, str) else entry
        own = entry.reward is not None and entry.reward != run_reward.spec
        reward = RewardFn(entry.reward, on_error=cfg.reward.on_error, workers=cfg.reward.workers,
                          timeout_s=cfg.reward.timeout_s) if own else run_reward
        reward.check_signatures()  # its own: callable as the run calls it (the run's is checked already)
        new = read_sets(entry.path, cfg, reward, count=None if d.eval_size is None else max(d.eval_size, 1),
                        exclude=training, name=entry.name, taken=taken(sets, reserved))
        for s in new:
            s.own_reward = own
        add_sets(sets, new, "eval.data", reserved)
    return sets


def eval_sets_of(cfg: RunConfig, source: Source, tokenizer: Any, run_reward: RewardFn, training: Sequence[str] = (),
                 read: Sequence[EvalSet] | None = None) -> list[EvalSet]:
    """The run's ``eval.data`` sets read (:func:`eval_rows_of`; ``read``: what it read already)
    and rendered for the model."""
    read = eval_rows_of(cfg, source, run_reward, training) if read is None else read
    return [render_set(s, cfg, tokenizer) for s in read]


#: The set name the held-out split's per-task metrics take (``eval/heldout/<task>/...``)
HELDOUT = HELDOUT_TASKS.removeprefix("eval/")


def taken(sets: Sequence[EvalSet], reserved: Sequence[str] = ()) -> list[str]:
    """The names a new set's file name may not become: the sets' and the ``reserved`` ones (the
    held-out split's per-task metrics', on a run whose source has tasks)."""
    return [s.name for s in sets] + list(reserved)


def add_sets(sets: list[EvalSet], new: Sequence[EvalSet], where: str, reserved: Sequence[str] = ()) -> None:
    """``sets`` += ``new``; a ConfigError when two sets would log under one name, or one under
    ``reserved`` (the held-out split's per-task metrics, ``eval/heldout/...``, when there are)."""
    for s in new:
        if s.name in [x.name for x in sets]:
            raise ConfigError(f"{where}: two sets are named {s.name!r}; give them different names")
        if s.name.split("/")[0] in reserved:
            raise ConfigError(f"{where}: the set {s.name!r} would log under {HELDOUT_TASKS}/, the held-out "
                              "split's per-task metrics; give it another name")
        sets.append(s)


def command_reward(cfg: RunConfig, paths: Sequence[str | Path], given: str | None, is_run: bool) -> str:
    """``rldsl eval``'s reward: ``given`` (``--reward``), else a run's own (``is_run``: ``cfg`` is
    its saved config), else the one the sets' sources share (data/sources.py ``default_reward``)."""
    if given:
        return given
    if is_run and cfg.reward.name:
        return cfg.reward.name
    return default_reward(cfg, [str(p) for p in paths])


def command_sets(paths: Sequence[str | Path], cfg: RunConfig, reward: RewardFn,
                 note: Callable[[str], None] | None = None) -> list[EvalSet]:
    """``rldsl eval``'s sets, each path read as the run (``cfg``) reads its data, before the model
    loads (rendered afterwards: :func:`render_set`); reasoning-gym data that is the run's own gets
    its options and none of its training questions."""
    sets: list[EvalSet] = []
    for path in paths:
        add_sets(sets, read_sets(path, cfg, reward, count=cfg.data.eval_size, taken=taken(sets), note=note),
                 "--data")
    return sets
