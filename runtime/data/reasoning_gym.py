"""reasoning-gym tasks as training data, their verifiers as the reward, their curricula.

``data.path = "reasoning_gym:NAME"`` (or a mix, ``"reasoning_gym:A=2,B=1"``) generates
prompts with reasoning-gym (``pip install 'rldsl[tasks]'``): the training rows are
``data.options.size`` entries of a ``reasoning_gym.composite.CompositeDataset`` (one task, or
the mix drawn with its weights) from ``data.options.seed``; the held-out rows come from another
seed, far from the training one (reasoning-gym seeds row i with ``seed + i``), and every
held-out question that is also a training question is dropped (the run says how many). Each
row is an ``Example`` whose prompt is the question (rendered with the system prompt by the
chat template, or in the plain format: system prompt, blank line, question), whose answer is
reasoning-gym's answer, and whose entry (question, answer, metadata) is kept in this process'
table of entries, keyed by the question: the ``reasoning_gym`` reward scores a completion with
the entry's own task's ``score_answer`` on the answer extracted from it. docs/reasoning_gym.md.
"""
from __future__ import annotations

import difflib
import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from .datasets import Example, PromptSource
from ..errors import ConfigError, DataError

PREFIX = "reasoning_gym:"
#: The extra that installs reasoning-gym.
EXTRA = "pip install 'rldsl[tasks]'  (reasoning-gym)"
#: Keys of ``data.options`` that are not a task's own: the training set's size and seed.
RESERVED = ("size", "seed")
DEFAULT_SIZE = 1000
#: Offset of the held-out seed from the training seed: reasoning-gym seeds row i with
#: ``seed + i``, so a nearby seed would hand the held-out set the training rows shifted by one.
HELDOUT_SEED_OFFSET = 1_000_000_007
#: The answer rules of the ``reasoning_gym`` reward.
ANSWER_FORMATS = ("tag", "plain")


def default_system_prompt() -> str:
    """reasoning-gym's ``SYSTEM_PROMPTS["default"]``: think step by step, answer in ``<answer>`` tags."""
    require()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


def row_system_prompt(path: str | None, given: str | None) -> str | None:
    """The system prompt of a row of data ``path``: the one decision every rollout path reads
    (single-turn prompts, the tools / env / agent episodes' ``row["system"]``, evaluation sets).
    ``given`` (``data.system_prompt``) when set, ``""`` meaning none; unset, reasoning-gym's
    default for reasoning-gym data (the one asking for the ``<answer>`` tags its reward reads),
    none for any other data."""
    if given is None:
        return default_system_prompt() if is_reasoning_gym(path) else None
    return given or None


def is_reasoning_gym(path: str | None) -> bool:
    """Whether ``data.path`` names reasoning-gym tasks."""
    return isinstance(path, str) and path.startswith(PREFIX)


def require() -> Any:
    """The ``reasoning_gym`` module, or a DataError naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise DataError(f"reasoning-gym tasks need reasoning-gym, which is not installed ({e}): {EXTRA}") from None
    return reasoning_gym


def task_names() -> list[str]:
    """Every task reasoning-gym registers, sorted."""
    require()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _check_name(name: str) -> None:
    names = task_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
        rest = [n for n in names if n not in close]
        raise DataError(f"unknown reasoning-gym task {name!r}; valid tasks (closest first): "
                        + ", ".join(close + rest))


def parse_tasks(path: str) -> list[tuple[str, float]]:
    """``"reasoning_gym:A=2,B=1"`` -> ``[("A", 2.0), ("B", 1.0)]`` (weight 1 when omitted);
    unknown names, repeated names and weights that are not positive numbers are DataErrors."""
    body = path[len(PREFIX):] if path.startswith(PREFIX) else path
    if not body.strip():
        raise DataError(f"data.path {path!r} names no task: write reasoning_gym:NAME (or NAME1=w1,NAME2=w2)")
    tasks: list[tuple[str, float]] = []
    for part in body.split(","):
        name, eq, weight_text = part.strip().partition("=")
        name = name.strip()
        if not name:
            raise DataError(f"data.path {path!r}: an empty task name")
        try:
            weight = float(weight_text) if eq else 1.0
        except ValueError:
            raise DataError(f"data.path {path!r}: the weight of {name!r} is {weight_text.strip()!r}, "
                            "not a number") from None
        if not (math.isfinite(weight) and weight > 0):
            raise DataError(f"data.path {path!r}: the weight of {name!r} is {weight_text.strip()}; "
                            "weights must be positive numbers")
        if name in (n for n, _ in tasks):
            raise DataError(f"data.path {path!r}: task {name!r} appears twice")
        _check_name(name)
        tasks.append((name, weight))
    return tasks


@dataclass(frozen=True)
class TaskOptions:
    """``data.options`` read for tasks ``names``: the training set's size and seed, and each
    task's own config keys. A mix takes a table per task (``[data.options.chain_sum]``); a single
    task takes its keys at the top level too."""

    size: int
    seed: int
    per_task: dict[str, dict[str, Any]]


def read_options(options: Mapping[str, Any], names: Sequence[str], run_seed: int) -> TaskOptions:
    size = options.get("size", DEFAULT_SIZE)
    seed = options.get("seed", run_seed)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DataError(f"data.options.size must be a positive integer, got {size!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise DataError(f"data.options.seed must be a non-negative integer, got {seed!r}")
    per_task: dict[str, dict[str, Any]] = {n: {} for n in names}
    for key, value in options.items():
        if key in RESERVED:
            continue
        if key in per_task and isinstance(value, Mapping):
            per_task[key].update(value)
        elif len(names) == 1:
            per_task[names[0]][key] = value
        else:
            raise DataError(f"data.options.{key}: in a mix, a task's options go in a table named after "
                            f"the task ([data.options.{names[0]}] ...); the mix's tasks: {', '.join(names)}")
    for name, opts in per_task.items():
        for key in RESERVED:
            if key in opts:
                raise DataError(f"data.options.{name}.{key}: the training set's {key} is data.options.{key} "
                                "(one for the whole mix)")
        _check_task_options(name, opts)
    return TaskOptions(size, seed, per_task)


def _check_task_options(name: str, opts: dict[str, Any]) -> None:
    """Build the task's config once, so that an unknown key or a bad value fails here, named."""
    require()
    from reasoning_gym.factory import DATASETS

    _, config_cls = DATASETS[name]
    try:
        config = config_cls(**opts, size=1, seed=0)
        if hasattr(config, "validate"):
            config.validate()
    except TypeError as e:
        import dataclasses

        known = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED)
        raise DataError(f"data.options for reasoning-gym task {name!r}: {e} (reasoning-gym's "
                        f"{config_cls.__name__}); its options: {', '.join(known)}") from None
    except (AssertionError, ValueError) as e:
        raise DataError(f"data.options for reasoning-gym task {name!r}: reasoning-gym's "
                        f"{config_cls.__name__} refuses them: {e or type(e).__name__}") from None


# ------------------------------------------------------------------- the table of entries
class _Entries:
    """question -> (task, entry) of every row generated in this process, and the dataset (with
    the options it was generated with) that scores it (thread-safe: rewards may be scored from
    worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rows: dict[str, tuple[str, dict]] = {}
        self._scorers: dict[str, Any] = {}

    def add(self, entries: Iterable[dict], datasets: Mapping[str, Any]) -> None:
        """Keep ``entries`` with the dataset of their task (``datasets``: task -> dataset)."""
        with self._lock:
            for e in entries:
                task = e["metadata"]["source_dataset"]
                if e["question"] not in self.rows:
                    self.rows[e["question"]] = (task, e)
                    self._scorers[e["question"]] = datasets[task]

    def get(self, question: str) -> tuple[Any, dict]:
        """(the dataset that scores it, the entry) of the row whose question this is."""
        with self._lock:
            found = self.rows.get(question)
            if found is None:
                raise ValueError("no reasoning-gym entry has this prompt as its question: the "
                                 "reasoning_gym reward scores rows of reasoning_gym: data generated "
                                 "in this process")
            return self._scorers[question], found[1]


ENTRIES = _Entries()


def extract(completion: str, answer_format: str = "tag") -> str | None:
    """The answer a completion gives: ``tag`` = reasoning-gym's ``extract_answer`` (the last
    ``<answer>...</answer>``, stripped; None without one), ``plain`` = the whole completion,
    stripped."""
    if answer_format == "tag":
        require()
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion)
    if answer_format == "plain":
        return completion.strip()
    raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")


def reasoning_gym_reward(prompt: str, completion: str, answer: str, *, finish_reason: str = "stop",
                         answer_format: str = "tag") -> float:
    """The entry's own task's ``score_answer`` on the answer extracted from the completion
    (``answer_format``): a float in [0, 1], partial credit kept. A completion cut off at the
    length limit is scored the same way (no answer tag: 0)."""
    scorer, entry = ENTRIES.get(prompt)
    return float(scorer.score_answer(extract(completion, answer_format), entry))


def task_of(question: str) -> str | None:
    """The task whose entry has this question (None for a prompt that is not one)."""
    found = ENTRIES.rows.get(question)
    return found[0] if found else None


# ------------------------------------------------------------------------- generation
def _composite(tasks: Sequence[tuple[str, float]], opts: TaskOptions, seed: int, size: int,
               configs: Mapping[str, dict[str, Any]] | None = None) -> Any:
    require()
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    specs = [DatasetSpec(name=n, weight=w, config=dict((configs or opts.per_task)[n])) for n, w in tasks]
    return CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=specs))


def _example(i: int, entry: dict) -> Example:
    return Example(id=i, prompt=entry["question"], answer=str(entry["answer"]), source=entry["question"])


@dataclass
class GeneratedData:
    """A run's reasoning-gym rows: training and held-out examples, and what the run says."""

    tasks: list[tuple[str, float]]
    options: TaskOptions
    train: list[Example]
    heldout: list[Example]
    notes: list[str]


def training_entries(path: str, options: Mapping[str, Any], *, run_seed: int) -> list[dict]:
    """The training entries of ``data.path`` / ``data.options`` exactly as a run generates them
    (what an embedded model's warm start trains on)."""
    tasks = parse_tasks(path)
    opts = read_options(options, [n for n, _ in tasks], run_seed)
    ds = _composite(tasks, opts, opts.seed, opts.size)
    return [ds[i] for i in range(opts.size)]


def generate(path: str, options: Mapping[str, Any], *, run_seed: int, heldout: int,
             exclude: Iterable[str] = ()) -> GeneratedData:
    """Training rows and ``heldout`` held-out rows of ``data.path`` (module doc). ``exclude``:
    questions the held-out rows must not hold besides the training ones."""
    tasks = parse_tasks(path)
    opts = read_options(options, [n for n, _ in tasks], run_seed)
    train_ds = _composite(tasks, opts, opts.seed, opts.size)
    train_entries = [train_ds[i] for i in range(opts.size)]
    ENTRIES.add(train_entries, train_ds.datasets)
    taken = {e["question"] for e in train_entries} | set(exclude)
    held_entries, dropped = draw_unseen(tasks, opts, opts.seed + HELDOUT_SEED_OFFSET, heldout, taken)
    notes = [f"reasoning-gym {', '.join(f'{n}' + (f' (weight {w:g})' if len(tasks) > 1 else '') for n, w in tasks)}: "
             f"{opts.size} training rows from seed {opts.seed}"
             + (f", {len(held_entries)} held-out rows from seed {opts.seed + HELDOUT_SEED_OFFSET} "
                f"({dropped} dropped: their question is also a training question)" if heldout else "")]
    return GeneratedData(tasks, opts, [_example(i, e) for i, e in enumerate(train_entries)],
                         [_example(i, e) for i, e in enumerate(held_entries)], notes)


def draw_unseen(tasks: Sequence[tuple[str, float]], opts: TaskOptions, seed: int, count: int,
                taken: set[str]) -> tuple[list[dict], int]:
    """``count`` entries from ``seed`` whose questions are all distinct and not in ``taken``
    (generated until there are enough), and how many were dropped on the way."""
    if count <= 0:
        return [], 0
    budget = max(10 * count, 1000)  # a task with few distinct questions runs out: say so
    ds = _composite(tasks, opts, seed, budget)
    out: list[dict] = []
    seen = set(taken)
    dropped = 0
    for i in range(budget):
        e = ds[i]
        if e["question"] in seen:
            dropped += 1
            continue
        seen.add(e["question"])
        out.append(e)
        if len(out) == count:
            ENTRIES.add(out, ds.datasets)
            return out, dropped
    raise DataError(f"reasoning-gym {', '.join(n for n, _ in tasks)}: only {len(out)} of {budget} generated "
                    f"held-out questions are new (not training questions, not repeated); lower "
                    f"data.eval_size ({count}) or data.options.size, or widen the task's options")


# --------------------------------------------------------------------------- metrics
def task_metrics(questions: Sequence[str], rewards: torch.Tensor, prefix: str = "task/") -> dict[str, float]:
    """``task/<task>/reward`` (mean reward) and ``task/<task>/acc`` (fraction with full credit,
    reward >= 1) over rows ``rewards [P, G]`` whose prompt ``questions[p]`` is a reasoning-gym
    question; NaN rewards (a failed reward) are left out of the mean, count as not solved."""
    by_task: dict[str, list[torch.Tensor]] = {}
    for q, row in zip(questions, rewards):
        t = task_of(q)
        if t is not None:
            by_task.setdefault(t, []).append(row)
    out: dict[str, float] = {}
    for t, rows in sorted(by_task.items()):
        r = torch.cat([x.reshape(-1) for x in rows])
        finite = torch.isfinite(r)
        out[f"{prefix}{t}/reward"] = float(r[finite].mean()) if finite.any() else float("nan")
        out[f"{prefix}{t}/acc"] = float(((r >= 1.0 - 1e-9) & finite).float().mean())
    return out


# ------------------------------------------------------------------------- curricula
@dataclass(frozen=True)
class CurriculumSettings:
    """When a task's level moves: over its last ``window`` scored samples, a mean reward at or
    above ``raise_at`` moves it up, at or below ``lower_at`` down (then the window restarts)."""

    window: int = 64
    raise_at: float = 0.7
    lower_at: float = 0.2


def raise_one(curriculum: Any) -> bool:
    """Move one attribute up: the lowest-level one that can still rise (the first declared among
    equals). False when every attribute is at its top level."""
    levels = [(curriculum.get_attr_level(a), i, a) for i, a in enumerate(curriculum.attributes)
              if curriculum.get_attr_level(a) < len(curriculum.attributes[a].levels) - 1]
    return bool(levels) and curriculum.increment_attr_level(min(levels)[2])


def lower_one(curriculum: Any) -> bool:
    """Move one attribute down: the highest-level one (the last declared among equals). False when
    every attribute is at level 0."""
    levels = [(curriculum.get_attr_level(a), i, a) for i, a in enumerate(curriculum.attributes)
              if curriculum.get_attr_level(a) > 0]
    return bool(levels) and curriculum.decrement_attr_level(max(levels)[2])


class ReasoningGymSource(PromptSource):
    """The training rows of reasoning-gym tasks: a :class:`PromptSource` that also reports
    per-task metrics and, with a curriculum, regenerates a task's rows when its level moves.

    Levels follow reasoning-gym's curricula (``reasoning_gym.coaching``): each task starts at
    level 0 of every attribute and moves one attribute at a time (:func:`raise_one`,
    :func:`lower_one`); its options are the curriculum's ``generate_configuration`` at those
    levels (reasoning-gym's default, inclusive ranges: level k of a range attribute spans levels
    0..k) over ``data.options``. The rows keep their ids
    (row i of the training set is regenerated at the new levels; one that would be a held-out
    question is skipped over), so the dealing order and a resume stay exact. ``state_dict`` holds
    the levels.
    """

    def __init__(self, data: GeneratedData, examples: Sequence[Example], *, seed: int, name: str,
                 curriculum: CurriculumSettings | None, heldout_questions: Iterable[str] = (),
                 render: Callable[[Example], Example] | None = None) -> None:
        super().__init__(examples, seed=seed, name=name)
        self.data = data
        self.render = render if render is not None else (lambda e: e)
        self.settings = curriculum
        self._held = set(heldout_questions)
        self._lock = threading.RLock()
        self.curricula: dict[str, Any] = {}
        self._recent: dict[str, deque] = {}
        if curriculum is not None:
            require()
            from reasoning_gym.factory import create_curriculum, has_curriculum

            for name_, _ in data.tasks:
                if not has_curriculum(name_):
                    raise DataError(f"data.curriculum: reasoning-gym has no curriculum for task {name_!r}")
                self.curricula[name_] = create_curriculum(name_)
                self._recent[name_] = deque(maxlen=curriculum.window)
            self._regenerate()

    # levels ----------------------------------------------------------------------------
    def levels(self) -> dict[str, dict[str, int]]:
        return {t: {a: c.get_attr_level(a) for a in c.attributes} for t, c in self.curricula.items()}

    def _configs(self) -> dict[str, dict[str, Any]]:
        """Each task's options with its curriculum's attributes at their current levels."""
        out = {}
        for t, opts in self.data.options.per_task.items():
            c = self.curricula.get(t)
            if c is None:
                out[t] = dict(opts)
                continue
            config = c.generate_configuration(defaults=dict(opts))
            out[t] = {k: v for k, v in vars(config).items() if k not in RESERVED}
        return out

    def _regenerate(self) -> None:
        """Row i of the training set at the current levels (held-out questions skipped over)."""
        o = self.data.options
        ds = _composite(self.data.tasks, o, o.seed, o.size, self._configs())
        rows: list[dict] = []
        i = 0
        while len(rows) < o.size:  # a composite answers any index (its size is virtual)
            if i >= 100 * o.size:
                raise DataError(f"{self.name}: the curriculum's level generates held-out questions only")
            e = ds[i]
            i += 1
            if e["question"] not in self._held:
                rows.append(e)
        ENTRIES.add(rows, ds.datasets)
        self.examples = [self.render(_example(k, e)) for k, e in enumerate(rows)]

    # the step's hooks --------------------------------------------------------------------
    def next_batch(self, num_prompts: int) -> list[Example]:
        with self._lock:
            return super().next_batch(num_prompts)

    def observe(self, examples_ids: Sequence[int], rewards: torch.Tensor) -> dict[str, float]:
        """Per-task metrics of a step's rewards ``[P, G]`` (rows of prompts ``examples_ids``), and
        the curriculum's moves and levels (``curriculum/<task>/<attribute>``)."""
        with self._lock:
            questions = [self.examples[self._by_id[i]].reward_prompt for i in examples_ids]
            m = task_metrics(questions, rewards)
            if not self.curricula:
                return m
            moved = False
            for q, row in zip(questions, rewards):
                t = task_of(q)
                if t in self._recent:
                    self._recent[t].extend(float(x) if math.isfinite(float(x)) else 0.0 for x in row)
            for t, recent in self._recent.items():
                if len(recent) < recent.maxlen:
                    continue
                mean = sum(recent) / len(recent)
                c = self.curricula[t]
                if (mean >= self.settings.raise_at and raise_one(c)) or \
                        (mean <= self.settings.lower_at and lower_one(c)):
                    moved = True
                    recent.clear()
            if moved:
                self._regenerate()
            for t, attrs in self.levels().items():
                for a, level in attrs.items():
                    m[f"curriculum/{t}/{a}"] = float(level)
            return m

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            state = super().state_dict()
            if self.curricula:
                state["curriculum"] = {"levels": self.levels(),
                                       "recent": {t: list(r) for t, r in self._recent.items()}}
            return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            saved = state.get("curriculum")
            if self.curricula:
                if saved is None:
                    raise ValueError(f"{self.name}: the checkpoint has no curriculum levels "
                                     "(it was saved without data.curriculum)")
                for t, attrs in saved["levels"].items():
                    for a, level in attrs.items():
                        self.curricula[t].set_attr_level(a, int(level))
                for t, values in saved["recent"].items():
                    self._recent[t].clear()
                    self._recent[t].extend(values)
                self._regenerate()
            super().load_state_dict(state)


def check_reward(reward: Any) -> None:
    """Every ``reasoning_gym`` term of a ``RewardFn`` names a known answer format (a bad
    ``reasoning_gym(answer_format=...)`` fails here, not on every sample)."""
    for term in getattr(reward, "terms", ()):
        fn = term.fn
        if getattr(fn, "func", None) is reasoning_gym_reward:
            fmt = fn.keywords.get("answer_format", "tag")
            if fmt not in ANSWER_FORMATS:
                raise ConfigError(f"reward {term.name!r}: answer_format must be one of "
                                  f"{', '.join(ANSWER_FORMATS)}, got {fmt!r}")


def check_config(cfg: Any) -> None:
    """What a run on reasoning-gym data needs, checked before anything loads."""
    if cfg.distributed.uses_ray:
        raise ConfigError("reasoning_gym: data runs in one process for now (its entries live in the "
                          "driver's table): drop distributed.trainers / rollout_workers / ray_address")
    if cfg.data.eval_path is not None:
        raise ConfigError("data.eval_path with reasoning_gym: data: the held-out rows are generated "
                          "(data.eval_size of them, from another seed); use eval.data for more sets")


#: The seed offset of evaluation sets (``eval.data``, ``rldsl eval``): twice the held-out one.
EVAL_SEED_OFFSET = 2 * HELDOUT_SEED_OFFSET


def generate_eval(path: str, options: Mapping[str, Any], *, run_seed: int, count: int,
                  exclude: Iterable[str] = ()) -> tuple[dict[str, list[Example]], str]:
    """An evaluation set of ``count`` rows of ``path`` from a third seed, none of them in ``exclude``
    (the run's training questions), split by task: (task -> its rows, a note)."""
    tasks = parse_tasks(path)
    opts = read_options(options, [n for n, _ in tasks], run_seed)
    seed = opts.seed + EVAL_SEED_OFFSET
    entries, dropped = draw_unseen(tasks, opts, seed, count, set(exclude))
    by_task: dict[str, list[Example]] = {n: [] for n, _ in tasks}
    for i, e in enumerate(entries):
        by_task[e["metadata"]["source_dataset"]].append(_example(i, e))
    note = (f"{path}: {count} evaluation rows from seed {seed} ({dropped} dropped: a training question "
            "or a repeat)")
    return {t: rows for t, rows in by_task.items() if rows}, note
