"""Where a run's prompts come from: one table of prompt sources, a :class:`Source` per kind.

Every kind of source -- a data file, reasoning-gym's generated tasks, a built-in task, a
verifiers taskset -- answers the same questions here and nowhere else: its rows and held-out
split, its default reward, tools, system prompt and ``max_new_tokens``, the checks it needs
before anything loads and (for a built-in task) its embedded model. The data file is this
module's own row; the others are declared where their code lives -- reasoning-gym in
data/reasoning_gym.py (its row, with the embedded model that trains on it, in toy/sources.py), the
built-in tasks in toy/sources.py and toy/shapes_source.py, a verifiers taskset in
rollout/multi_turn.py -- and registered from one list, :data:`BUILT_IN` (this module imports neither
toy/ nor rollout/: it names them).

:func:`source_of` answers "which source is this run's" once: run/plan.py asks it (the one caller
outside this module), binds it to the run (``Plan.source``, then ``Run.source``) and hands it to
every reader of the run's rows, prompts, model, checks, system prompt and rows' tasks; an
evaluation set's own source is :func:`eval_source`'s.
"""
from __future__ import annotations

import importlib

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..config import DATA_MAX_NEW_TOKENS, RunConfig, env_library
from ..errors import ConfigError, RunError
from .datasets import Example, PromptSource, load_examples, split_heldout

#: Held-out rows when ``data.eval_size`` is unset: all of a source that draws its own (a built-in
#: task's, reasoning-gym's), at most this many of the rows split off a data file or a taskset
HELDOUT_ROWS = 200

Render = Callable[[Example], Example]
#: ``eval_rows(cfg, path, count, exclude)`` -> (set label -> rows, a note or None): see :class:`Source`
EvalRows = Callable[[RunConfig, str, "int | None", "Sequence[str] | None"], "tuple[dict[str, list[Example]], str | None]"]


@dataclass
class Rows:
    """A source's rows as read (unrendered): ``train`` and ``heldout``, the ``notes`` the run
    prints about them, and ``data``, what the source keeps for its prompts (reasoning-gym's
    generated data, a built-in task's prompt source)."""

    train: list[Example]
    heldout: list[Example]
    notes: list[str] = field(default_factory=list)
    data: Any = None


def _no_system_prompt() -> str | None:
    return None


def _no_task(prompt: str) -> str | None:
    return None


def _file_eval_rows(cfg: RunConfig, path: str, count: int | None,
                    exclude: Sequence[str] | None) -> tuple[dict[str, list[Example]], str | None]:
    d = cfg.data
    return {"": load_examples(path, prompt_field=d.prompt_key, answer_field=d.answer_key, image_field=d.image_key,
                              max_images=d.max_images)}, None


def _plain_prompts(cfg: RunConfig, rows: Rows, train: list[Example], held: list[Example],
                   render: Render | None) -> PromptSource:
    return PromptSource(train, seed=cfg.seed, name=Path(cfg.data.path).name if cfg.data.path else cfg.rollout.env)


@dataclass(frozen=True)
class Source:
    """One kind of prompt source, a row of the table.

    ``claims(cfg)``: whether a run's config reads its prompts from this kind (of several that
    claim it, the one of highest ``precedence``); ``rows(cfg)``: its :class:`Rows`, read before
    any model loads (a missing file, field or package fails there); ``prompts(cfg, rows, train,
    held, render)``: the run's training :class:`PromptSource` from the rows (``train`` / ``held``
    rendered with ``render`` when ``rendered`` and a tokenizer is given); ``what``: the source in
    the run-start line that names the default reward. ``reward``, ``tools``, ``max_new_tokens``,
    ``system_prompt()``: the defaults it fills into a run that leaves them unset. ``check(cfg)``:
    what it needs of the config, checked first. ``model(cfg)`` -> (folder, label) and
    ``tokenizer()``: the embedded model a run without ``model.path`` trains (a built-in task's),
    and its tokenizer (the task's prompts are written in its vocabulary); ``vision``: that model
    reads images (prompts with images are refused before a text model loads). ``eval_rows(cfg,
    path, count, exclude)``: the rows of an evaluation set ``path`` of this kind (``eval.data``, ``rldsl
    eval --data``) as (set label -> rows, a note or None): one set labelled ``""`` (named after the
    file), or one per task; ``count`` rows where the source draws its own (None: its default),
    none of the questions in ``exclude`` (None: the run's training questions when ``path`` is the
    run's data). ``task_of(prompt)``: the task a held-out row's prompt (its reward prompt) belongs
    to, by which the held-out metrics are also split (``eval/heldout/<task>/...``); None for every
    row of a kind without tasks.
    """

    name: str
    what: str
    claims: Callable[[RunConfig], bool]
    rows: Callable[[RunConfig], Rows]
    reward: str
    prompts: Callable[[RunConfig, Rows, list[Example], list[Example], Render | None], PromptSource] = _plain_prompts
    max_new_tokens: int = DATA_MAX_NEW_TOKENS
    tools: str | None = None
    system_prompt: Callable[[], str | None] = _no_system_prompt
    rendered: bool = True
    check: Callable[[RunConfig], None] | None = None
    model: Callable[[RunConfig], tuple[Path, str]] | None = None
    tokenizer: Callable[[], Any] | None = None
    vision: bool = False
    eval_rows: EvalRows = _file_eval_rows
    task_of: Callable[[str], str | None] = _no_task
    precedence: int = 0

    @property
    def has_tasks(self) -> bool:
        """Whether its rows belong to tasks (``task_of``): the held-out metrics are then split by
        task too, under ``eval/heldout/<task>/``."""
        return self.task_of is not _no_task


#: The table: source name -> its row (the built-in kinds: :data:`BUILT_IN`; a user's: :func:`register`)
SOURCES: dict[str, Source] = {}

#: The built-in kinds, the table's rows before any other: each module and the names of the rows it
#: declares, registered in this order the first time the table is asked or added to. Named, not
#: imported: this module imports neither toy/ nor rollout/. (The data file's row, ``FILE``, is this
#: module's own.)
BUILT_IN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("rldsl.runtime.data.sources", ("FILE",)),
    ("rldsl.runtime.toy.sources", ("ADDITION", "CALCULATOR", "REASONING_GYM")),
    ("rldsl.runtime.toy.shapes_source", ("SOURCE",)),
    ("rldsl.runtime.rollout.multi_turn", ("TASKSET",)),
)
_registered: list[Source] = []  # the built-in rows, once registered


def _built_in() -> None:
    """Register the built-in rows (once): a run, a test and ``rldsl eval`` see the same table
    whichever module they imported first."""
    if _registered:
        return
    for module, names in BUILT_IN:
        rows = importlib.import_module(module)
        _registered.extend(getattr(rows, name) for name in names)
    for source in _registered:
        SOURCES.setdefault(source.name, source)


def register(source: Source) -> Source:
    """Add (or replace) ``source``'s row in the table (after the built-in ones); returns it."""
    _built_in()
    SOURCES[source.name] = source
    return source


def source_of(cfg: RunConfig) -> Source:
    """The run's source: of the rows that claim ``cfg``, the one of highest precedence."""
    _built_in()
    claimed = [s for s in SOURCES.values() if s.claims(cfg)]
    if not claimed:
        raise ConfigError(f"no prompt source reads data.path={cfg.data.path!r} / data.task={cfg.data.task!r} "
                          f"(the table holds: {', '.join(SOURCES)}); the built-in tasks register theirs in "
                          "rldsl.runtime.toy.sources")
    return max(claimed, key=lambda s: s.precedence)


def with_data(cfg: RunConfig, path: str | Path) -> RunConfig:
    """``cfg`` reading ``path`` (an evaluation set's source is asked as a run's)."""
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"path": str(path)})})


def eval_source(cfg: RunConfig, path: str | Path) -> Source:
    """The source of an evaluation set ``path`` (``eval.data``, ``rldsl eval --data``): the table
    asked for that path, as for a run reading it (a set is not the run's data: its own question)."""
    return source_of(with_data(cfg, path))


def _own_reward(cfg: RunConfig, library: str | None) -> tuple[str, str] | None:
    """(``env``, whose reward it is) when the run's episodes bring their own reward -- an agent's
    return value, an environment of verifiers / OpenEnv (``library``) --, else None."""
    if cfg.rollout.agent is not None:
        return "env", "an agent: its return value"
    if library is not None:
        return "env", f"an environment of {library}: its own reward"
    return None


def default_reward(cfg: RunConfig, data: Sequence[str | Path] = ()) -> str:
    """The reward a run scores with when it names none: ``env`` (the agent's return value, the
    environment's own reward) with ``rollout.agent`` or an environment of verifiers / OpenEnv,
    else its source's. ``data``: the sets ``rldsl eval`` reads instead of the run's own -- the
    reward their sources share, else a data file's."""
    if data:
        rewards = {source_of(with_data(cfg, p)).reward for p in data}
        return rewards.pop() if len(rewards) == 1 else FILE.reward
    return (_own_reward(cfg, env_library(cfg.rollout.env)) or (source_of(cfg).reward,))[0]


def reward_origin(cfg: RunConfig) -> str:
    """Whose default :func:`default_reward` is, for the run-start line."""
    own = _own_reward(cfg, env_library(cfg.rollout.env))
    return own[1] if own is not None else source_of(cfg).what


def _tools(cfg: RunConfig, source: Source) -> str | None:
    r = cfg.rollout
    return source.tools if r.tools is None and r.env is None and r.agent is None else r.tools


def max_new_tokens(cfg: RunConfig) -> int:
    """``rollout.max_new_tokens``, else the source's default."""
    return cfg.rollout.max_new_tokens if cfg.rollout.max_new_tokens is not None else source_of(cfg).max_new_tokens


def default_tools(cfg: RunConfig) -> str | None:
    """``rollout.tools``, else the source's tools (the calculator task's) when the run has no
    environment or agent of its own, else None."""
    return _tools(cfg, source_of(cfg))


def settle(cfg: RunConfig, source: Source) -> tuple[RunConfig, str | None]:
    """(``cfg`` with what it leaves to its prompt source ``source`` (bound by the plan) filled in --
    ``reward.name`` (:func:`default_reward`), ``rollout.tools`` (:func:`default_tools`),
    ``rollout.max_new_tokens`` --, whose default reward it took, for the run-start line: None when
    the config names its own). The plan settles a run's config once, before any check: the checks,
    the reward, the context clip and the episode runner then read the keys, and none asks the
    table for a default again. Settling a settled config changes nothing."""
    r = cfg.rollout
    named = cfg.reward.name
    reward, origin = (named, None) if named is not None else \
        _own_reward(cfg, env_library(r.env)) or (source.reward, source.what)
    rollout = {"tools": _tools(cfg, source),
               "max_new_tokens": r.max_new_tokens if r.max_new_tokens is not None else source.max_new_tokens}
    return cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"name": reward}),
                                  "rollout": r.model_copy(update=rollout)}), origin


def system_prompt(cfg: RunConfig, path: str | Path | None = None, source: Source | None = None) -> str | None:
    """The system prompt of the rows of ``path`` (default: the run's data, whose source the plan
    asked already: ``source``): ``data.system_prompt`` when set (``""`` meaning none), else the
    source's own (reasoning-gym's asks for the ``<answer>`` tags its reward reads; the others have
    none). Every rollout path reads it: single-turn prompts, evaluation sets, and the ``system``
    of the tools' / environments' / agents' rows."""
    given = cfg.data.system_prompt
    if given is not None:
        return given or None
    if source is None:
        source = source_of(cfg if path is None else with_data(cfg, path))
    return source.system_prompt()


def heldout_count(cfg: RunConfig) -> int:
    """Held-out rows of a source that draws its own: ``data.eval_size``, else :data:`HELDOUT_ROWS`."""
    return HELDOUT_ROWS if cfg.data.eval_size is None else cfg.data.eval_size


def heldout_size(cfg: RunConfig, rows: int) -> tuple[int, str | None]:
    """(held-out rows to split off a data file of ``rows`` rows, a line for the log or None).

    ``data.eval_size`` when set (an error if it leaves nothing to train on), else one tenth
    of the rows, at most :data:`HELDOUT_ROWS`, none below 10 rows: a small dataset starts without flags.
    """
    if cfg.data.eval_size is not None:
        if cfg.data.eval_size >= rows:
            raise RunError(f"data.eval_size={cfg.data.eval_size} holds out every one of the {rows} "
                           "rows: lower it (or set data.eval_path, or 0 for no evaluation)")
        return cfg.data.eval_size, None
    k = min(HELDOUT_ROWS, rows // 10)
    if k == 0:
        return 0, f"{rows} rows: no held-out split (set data.eval_path or data.eval_size to evaluate)"
    return k, f"held out {k} of {rows} rows for evaluation (data.eval_size to change)"


def split_rows(cfg: RunConfig, examples: list[Example]) -> Rows:
    """``examples`` split into training and held-out rows (:func:`heldout_size`, seeded by the run)."""
    k, note = heldout_size(cfg, len(examples))
    train, held = split_heldout(examples, k, seed=cfg.seed)
    return Rows(train, held, [note] if note else [])


def _file_rows(cfg: RunConfig) -> Rows:
    d = cfg.data
    t = cfg.teacher  # a privileged teacher's context column (the held-out rows of data.eval_path need none)
    examples = load_examples(d.path, prompt_field=d.prompt_key, answer_field=d.answer_key,
                             context_field=t.context_key, context_template=t.context_template,
                             image_field=d.image_key, max_images=d.max_images)
    if d.eval_path:
        return Rows(examples, load_examples(d.eval_path, prompt_field=d.prompt_key, answer_field=d.answer_key,
                                            image_field=d.image_key, max_images=d.max_images))
    return split_rows(cfg, examples)


#: A data file (``data.path``: .jsonl, .json, .parquet, a datasets folder): its rows, scored by
#: ``exact`` match of the answer
FILE = Source("file", "a data file", claims=lambda cfg: cfg.data.path is not None, rows=_file_rows, reward="exact")
