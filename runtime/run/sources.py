"""What a run reads before it builds anything: the policy's model folder and tokenizer (the
source's embedded model, warm-started on first use, or the user's) and the data's prompts, read
and split by the run's prompt source (data/sources.py: a data file, reasoning-gym's generated
rows, a verifiers taskset's tasks or a built-in task) and rendered for the model. A missing file
or field fails here, before any model loads.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

import rldsl

from ..config import DataConfig, RunConfig
from ..data.datasets import Example, PromptSource, render_prompt
from ..data.images import image_rows
from ..data.sources import SOURCES, Rows, Source, system_prompt
from ..errors import ConfigError, RunError
from ..models.kinds import folder_kind, text_kind
from ..models.loading import load_tokenizer
from ..resolve import check_tokenizer


def model_folder(cfg: RunConfig, source: Source) -> tuple[Path, str]:
    """(the policy's HF folder, a label for messages); without ``model.path``, the run's source's
    (``source``, bound by the plan) embedded model (another data file's: the default task's),
    warm-started on first use and read from its cache afterwards."""
    if cfg.model.path is None:
        embedded = source.model or SOURCES[DataConfig().task].model
        torch.set_num_threads(cfg.threads)  # a warm start trains here, before build() sets the run's threads
        return embedded(cfg)
    path = Path(cfg.model.path)
    if not path.exists():
        raise RunError(f"model folder not found: {path}")
    if not (path / "config.json").is_file():
        raise RunError(f"{path} is not a Hugging Face model folder (no config.json)")
    return path, str(path)


def model_of(algo: rldsl.Algorithm, cfg: RunConfig, source: Source) -> tuple[Path, str, Any]:
    """(the policy's model folder, a label for messages, its tokenizer), checked against what the
    run asks of them: a built-in task only on its embedded model's tokenizer unless asked for, a
    distill spec's teacher (set, same vocabulary, k <= V), a chat template for multi-turn episodes."""
    path, label = model_folder(cfg, source)  # the embedded model is warm-started here, once
    tok = load_tokenizer(path)
    check_task_vocabulary(cfg, tok, source)  # a user's model with no data: not the toy's task by default
    check_tokenizer(algo, cfg, path, tok)  # a teacher's vocabulary, the episodes' chat template
    return path, label, tok


def check_image_model(cfg: RunConfig, source: Source, sets: Sequence[tuple[str, Sequence[Example]]]) -> None:
    """Prompts with images (image parts, ``data.image_key``) need a vision-language policy: a
    text model (a ``model.path`` whose config.json has no ``vision_config``, or a source's embedded
    text model) is refused here with a ConfigError naming the data and its first such row, from
    the config and the rows alone, before any tokenizer or model loads (it failed after the model
    loaded: a chat template's TypeError, or a missing preprocessor_config.json). ``sets``: (what
    the rows are, e.g. ``data.path=train.jsonl``, the rows)."""
    if cfg.model.path is not None:
        kind = folder_kind(cfg.model.path)
        model = f"the model {cfg.model.path} is a text model (its config.json has no vision_config)"
    else:
        if (source if source.model is not None else SOURCES[DataConfig().task]).vision:  # as model_folder
            return
        kind, model = text_kind(), "the run trains the embedded toy model (no --model), a text model"
    for what, rows in sets:
        try:
            kind.check_prompts(what, image_rows(rows), len(rows))
        except ValueError as e:
            raise ConfigError(f"{e}, and {model} that cannot see them. Train a vision-language model (--model, "
                              "a Qwen2-VL-family folder; docs/vlm.md), or drop the images from the data") from None


def check_task_vocabulary(cfg: RunConfig, tokenizer: Any, source: Source) -> None:
    """A user's model (``model.path``) with no ``data.path`` would train on the built-in task
    (``data.task``: the embedded model's toy arithmetic, written in its character vocabulary):
    refused with a ConfigError naming data.path, unless ``data.task`` is set explicitly or the model
    has the embedded model's tokenizer (a copy of the toy, as the tests' models are)."""
    if cfg.model.path is None or source.tokenizer is None or "task" in cfg.data.model_fields_set:
        return
    if tokenizer.get_vocab() == source.tokenizer().get_vocab():
        return
    raise ConfigError(f"data.path is not set: the model {cfg.model.path} would train on the built-in "
                      f"'{cfg.data.task}' task, the embedded toy model's arithmetic. Give your prompts with "
                      f"--data FILE (data.path), or --set data.task={cfg.data.task} to train on the built-in "
                      f"task anyway")


def examples_of(cfg: RunConfig, source: Source, warn: Callable[[str], None] | None = None) -> Rows:
    """The run's source's training and held-out rows as read (unrendered); its notes go to ``warn``.
    A missing file, field or package fails here, before any model is read."""
    rows = source.rows(cfg)
    if warn is not None:
        for note in rows.notes:
            warn(note)
    return rows


def prompts_of(cfg: RunConfig, source: Source, tokenizer: Any = None, warn: Callable[[str], None] | None = None,
               rows: Rows | None = None) -> tuple[PromptSource, list[Example]]:
    """(training prompts, held-out prompts) of the run's source (``source``, bound by the plan).

    A source's rows are rendered for the model (``data.render_prompt``: chat template, system
    prompt) when a tokenizer is given, a built-in task's never (its prompts are in its model's
    format). ``rows``: what :func:`examples_of` read already.
    """
    rows = rows if rows is not None else examples_of(cfg, source, warn)
    train, held = rows.train, rows.heldout
    render = None
    if tokenizer is not None and source.rendered:
        d = cfg.data
        render = partial(render_prompt, tokenizer=tokenizer, mode=d.chat_template,
                         kwargs=d.chat_template_kwargs, system_prompt=system_prompt(cfg, source=source))
        train, held = [render(e) for e in train], [render(e) for e in held]
    return source.prompts(cfg, rows, train, held, render), held
