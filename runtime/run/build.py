"""Building a run in two steps: :func:`plan_run` settles everything that needs no weights
(the spec, parsed once; the checks; the data; the tokenizer; the resolved, frozen config that
config.json records), then :func:`build` loads the model(s) and starts the two sides a step
talks to -- in this process, or on Ray actors when the config asks for them. The models, the
engine and the reward come from one recipe (recipe.py) shared with the Ray workers.
"""
from __future__ import annotations

from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import rldsl
from rldsl.errors import SpecWarning

from ..batch import StepRollout
from ..config import RunConfig
from ..data.datasets import Example, PromptSource, load_examples, render_prompt, rollout_prompts, split_heldout
from ..errors import RunError
from ..models.loading import disable_transformers_progress, load_tokenizer
from ..recipe import environment_rows, reward_fn
from ..resolve import (check_async, check_device, check_engine, check_episode_template, check_group_size,
                       check_teacher, check_tools, resolve, settle_reward)
from ..data import reasoning_gym as rg
from ..data.reasoning_gym import is_reasoning_gym
from .evaluation import EvalSet, eval_sets_of
from ..rollout.producer import Produced
from ..records.trackers import check_trackers
from ..rewards.functions import RewardFn
from ..records.rng import seed_all
from ..toy.tasks import builtin_task, check_builtin_task, embedded_model
from ..workers.base import Rollouts, Trainers
from ..workers.start import start_workers


@dataclass
class Plan:
    """A run settled before any model loads; made by :func:`plan_run`, built by :func:`build`.

    ``cfg`` is resolved and frozen: what config.json records and what runs. ``notes`` and
    ``warnings`` (the spec's run-start warnings) are printed when the run starts.
    """

    cfg: RunConfig
    algo: rldsl.Algorithm
    model_path: Path
    tokenizer: Any
    source: PromptSource
    heldout: list[Example]
    reward: RewardFn
    notes: list[str] = field(default_factory=list)
    warnings: list[SpecWarning] = field(default_factory=list)
    eval_sets: list[EvalSet] = field(default_factory=list)


@dataclass
class Run:
    """Everything one training run is made of; built by :func:`build` (or :func:`build_run`).

    The step talks to ``rollouts`` and ``trainers`` only (workers/base.py): in process
    (``LocalRollouts`` / ``LocalTrainers``) or on Ray actors (``RayRollouts`` / ``RayTrainers``).
    ``tokenizer`` (the driver's copy) is saved with every checkpoint.
    """

    cfg: RunConfig
    algo: rldsl.Algorithm
    fn: rldsl.CompiledAlgorithm
    run_dir: Path
    tokenizer: Any
    source: PromptSource
    heldout: list[Example]
    rollouts: Rollouts
    trainers: Trainers
    reward: RewardFn  # the run's reward (the rollout workers score with their own copies of it)
    warn: Callable[[str], None] = print
    notes: list[str] = field(default_factory=list)
    warnings: list[SpecWarning] = field(default_factory=list)
    eval_sets: list[EvalSet] = field(default_factory=list)
    queued: list[Produced[StepRollout]] = field(default_factory=list)  # restored batches of an asynchronous run

    @property
    def episodes(self) -> bool:
        """Whether samples are multi-turn episodes (rollout.tools / rollout.env / rollout.agent)."""
        r = self.cfg.rollout
        return r.tools is not None or r.env is not None or r.agent is not None

    def rollout_prompts(self, examples: Sequence[Example]) -> list[str | tuple]:
        """What the rollouts start from (``data.rollout_prompts``)."""
        return rollout_prompts(examples, self.episodes)

    def close(self) -> None:
        """Stop the actors of a distributed run (nothing to do for a one-process run)."""
        self.rollouts.close()
        self.trainers.close()


def model_folder(cfg: RunConfig) -> tuple[Path, str]:
    """(the policy's HF folder, a label for messages); the embedded toy model is warm-started
    on first use and read from its cache afterwards."""
    if cfg.model.path is None:
        torch.set_num_threads(cfg.threads)  # a warm start trains here, before build() sets the run's threads
        return embedded_model(cfg)
    path = Path(cfg.model.path)
    if not path.exists():
        raise RunError(f"model folder not found: {path}")
    if not (path / "config.json").is_file():
        raise RunError(f"{path} is not a Hugging Face model folder (no config.json)")
    return path, str(path)


def heldout_size(cfg: RunConfig, rows: int) -> tuple[int, str | None]:
    """(held-out rows to split off a data file of ``rows`` rows, a line for the log or None).

    ``data.eval_size`` when set (an error if it leaves nothing to train on), else one tenth
    of the rows, at most 200, none below 10 rows: a small dataset starts without flags.
    """
    if cfg.data.eval_size is not None:
        if cfg.data.eval_size >= rows:
            raise RunError(f"data.eval_size={cfg.data.eval_size} holds out every one of the {rows} "
                           "rows: lower it (or set data.eval_path, or 0 for no evaluation)")
        return cfg.data.eval_size, None
    k = min(200, rows // 10)
    if k == 0:
        return 0, f"{rows} rows: no held-out split (set data.eval_path or data.eval_size to evaluate)"
    return k, f"held out {k} of {rows} rows for evaluation (data.eval_size to change)"


def examples_of(cfg: RunConfig, warn: Callable[[str], None] | None = None
                ) -> tuple[list[Example], list[Example]] | rg.GeneratedData | None:
    """(training rows, held-out rows) of ``data.path`` as read (unrendered), the generated rows of
    reasoning-gym tasks, or None for the built-in task. A missing file or field fails here,
    before any model is read."""
    examples = environment_rows(cfg)  # a verifiers taskset's tasks
    if examples is not None:
        k, note = heldout_size(cfg, len(examples))
        if note and warn is not None:
            warn(note)
        return split_heldout(examples, k, seed=cfg.seed)
    if cfg.data.path is None:
        return None
    if is_reasoning_gym(cfg.data.path):  # generated: a missing package, a bad name or option fails here
        generated = rg.generate(cfg.data.path, cfg.data.options, run_seed=cfg.seed,
                                heldout=200 if cfg.data.eval_size is None else cfg.data.eval_size)
        if warn is not None:
            for note in generated.notes:
                warn(note)
        return generated
    examples = load_examples(cfg.data.path, prompt_field=cfg.data.prompt_key,
                             answer_field=cfg.data.answer_key)
    if cfg.data.eval_path:
        return examples, load_examples(cfg.data.eval_path, prompt_field=cfg.data.prompt_key,
                                       answer_field=cfg.data.answer_key)
    k, note = heldout_size(cfg, len(examples))
    if note and warn is not None:
        warn(note)
    return split_heldout(examples, k, seed=cfg.seed)


def prompts_of(cfg: RunConfig, tokenizer: Any = None, warn: Callable[[str], None] | None = None,
               rows: tuple[list[Example], list[Example]] | None = None
               ) -> tuple[PromptSource, list[Example]]:
    """(training prompts, held-out prompts): the data file, or the built-in addition task.

    Data-file prompts are rendered for the model (``data.render_prompt``: chat template,
    system prompt) when a tokenizer is given. ``rows``: what :func:`examples_of` read already.
    """
    task = builtin_task(cfg)
    if task is not None:
        prompts = task.prompts()
        size = 200 if cfg.data.eval_size is None else cfg.data.eval_size
        held = prompts.heldout_examples()[:size] if size else []
        return prompts.prompt_source(cfg.seed), held
    rows = rows if rows is not None else examples_of(cfg, warn)
    generated = rows if isinstance(rows, rg.GeneratedData) else None
    train, held = (generated.train, generated.heldout) if generated is not None else rows  # type: ignore[misc]
    if tokenizer is not None:
        d = cfg.data
        render = partial(render_prompt, tokenizer=tokenizer, mode=d.chat_template,
                         kwargs=d.chat_template_kwargs, system_prompt=system_prompt(cfg))
        train, held = [render(e) for e in train], [render(e) for e in held]
    if generated is not None:
        d = cfg.data
        curriculum = rg.CurriculumSettings(d.curriculum_window, d.curriculum_raise,
                                           d.curriculum_lower) if d.curriculum else None
        source = rg.ReasoningGymSource(generated, train, seed=cfg.seed, name=cfg.data.path, curriculum=curriculum,
                                       heldout_questions=[e.reward_prompt for e in held],
                                       render=render if tokenizer is not None else None)
        return source, held
    return PromptSource(train, seed=cfg.seed, name=Path(cfg.data.path).name if cfg.data.path else cfg.rollout.env), held


def system_prompt(cfg: RunConfig) -> str | None:
    """``data.system_prompt``; null for reasoning-gym data means reasoning-gym's default one."""
    if cfg.data.system_prompt is None and is_reasoning_gym(cfg.data.path):
        return rg.default_system_prompt()
    return cfg.data.system_prompt


def load_spec(spec: str, spec_text: str | None = None) -> rldsl.Algorithm:
    """The run's spec, parsed once: ``spec_text`` (named ``spec``) when given, else the file or
    library name ``spec``."""
    return rldsl.loads(spec_text, spec) if spec_text is not None else rldsl.load(spec)


def plan_run(algo: rldsl.Algorithm, cfg: RunConfig) -> Plan:
    """Everything checked and settled before a model loads (runtime/resolve.py), cheapest first:
    the device, engine and trackers, the reward's name (a server's address, a reward model's folder), the data's fields, the model folder, the
    tokenizer and the model's context; then the resolved config and the group-size check.
    A mistake in any of them fails in seconds, never after a model load."""
    check_device(cfg)
    check_engine(cfg)
    check_async(algo, cfg)
    check_trackers(cfg.log.report_to)  # log.report_to names installed trackers
    if is_reasoning_gym(cfg.data.path):
        rg.check_config(cfg)
    cfg, reward_note = settle_reward(cfg)  # the task's own reward when none is named: decided once, here
    reward = reward_fn(cfg)  # an unknown name or a module that does not import fails here
    rg.check_reward(reward)  # reasoning_gym(answer_format=...) names a known format
    check_tools(cfg)
    notes: list[str] = []
    rows = examples_of(cfg, notes.append)
    path, label = model_folder(cfg)  # the toy model is warm-started here, once
    tok = load_tokenizer(path)
    check_builtin_task(cfg, tok)  # a user's model with no data: not the toy's task by default
    check_teacher(algo, cfg, path, tok)  # a distill spec's teacher: set, same vocabulary, k <= V
    check_episode_template(cfg, tok)
    source, held = prompts_of(cfg, tok, rows=rows)
    eval_sets = eval_sets_of(cfg, tok, reward, [e.reward_prompt for e in source.examples])
    resolved, more = resolve(cfg, path, tok, [e.prompt for e in source.examples + held]
                             + [e.prompt for s in eval_sets for e in s.examples], label)
    warnings = check_group_size(algo, resolved)
    return Plan(resolved, algo, path, tok, source, held, reward, notes + [reward_note] + more, warnings, eval_sets)


def build(plan: Plan, run_dir: Path) -> Run:
    """Load the model(s) of a planned run and start its engine(s) and trainer(s), in this
    process or on Ray actors (workers/start.py)."""
    cfg, algo, tok = plan.cfg, plan.algo, plan.tokenizer
    disable_transformers_progress()  # the bars would break the run's own progress display
    torch.set_num_threads(cfg.threads)
    seed_all(cfg.seed)
    fn = rldsl.compile(algo)
    rollouts, trainers = start_workers(cfg, algo, fn, plan.model_path, tok, plan.reward, run_dir)
    return Run(cfg, algo, fn, run_dir, tok, plan.source, plan.heldout, rollouts, trainers, plan.reward,
               notes=plan.notes, warnings=plan.warnings, eval_sets=plan.eval_sets)


def build_run(spec: str, cfg: RunConfig, run_dir: Path, spec_text: str | None = None) -> Run:
    """:func:`plan_run` then :func:`build`: a run of ``spec`` (``spec_text`` when given) under ``cfg``."""
    return build(plan_run(load_spec(spec, spec_text), cfg), run_dir)
