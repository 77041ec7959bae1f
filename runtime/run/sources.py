"""What a run reads before it builds anything: the policy's model folder and tokenizer (the
embedded toy's, warm-started on first use, or the user's) and the data's prompts -- a data file,
reasoning-gym's generated rows, an environment's rows or a built-in task -- split into training
and held-out rows and rendered for the model. A missing file or field fails here, before any
model loads.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

import rldsl

from ..config import RunConfig
from ..data import reasoning_gym as rg
from ..data.datasets import Example, PromptSource, load_examples, render_prompt, split_heldout
from ..data.reasoning_gym import is_reasoning_gym
from ..errors import RunError
from ..models.loading import load_tokenizer
from ..resolve import check_teacher
from ..rollout.runners import check_episode_template, environment_rows


def model_folder(cfg: RunConfig) -> tuple[Path, str]:
    """(the policy's HF folder, a label for messages); the embedded toy model is warm-started
    on first use and read from its cache afterwards."""
    if cfg.model.path is None:
        from ..toy.tasks import embedded_model  # torch, transformers: the toy is built here

        torch.set_num_threads(cfg.threads)  # a warm start trains here, before build() sets the run's threads
        return embedded_model(cfg)
    path = Path(cfg.model.path)
    if not path.exists():
        raise RunError(f"model folder not found: {path}")
    if not (path / "config.json").is_file():
        raise RunError(f"{path} is not a Hugging Face model folder (no config.json)")
    return path, str(path)


def model_of(algo: rldsl.Algorithm, cfg: RunConfig) -> tuple[Path, str, Any]:
    """(the policy's model folder, a label for messages, its tokenizer), checked against what the
    run asks of them: the toy's task only on the toy's tokenizer unless asked for, a distill
    spec's teacher (set, same vocabulary, k <= V), a chat template for multi-turn episodes."""
    from ..toy.tasks import check_builtin_task

    path, label = model_folder(cfg)  # the toy model is warm-started here, once
    tok = load_tokenizer(path)
    check_builtin_task(cfg, tok)  # a user's model with no data: not the toy's task by default
    check_teacher(algo, cfg, path, tok)
    check_episode_template(cfg, tok)
    return path, label, tok


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
    from ..toy.tasks import builtin_task

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
                         kwargs=d.chat_template_kwargs, system_prompt=rg.row_system_prompt(d.path, d.system_prompt))
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

