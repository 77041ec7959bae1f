"""The built-in tasks, one row per ``data.task``: each task's module declares its prompts and
embedded model (toy/warmup.py ``ADDITION``, toy/tool_warmup.py ``CALCULATOR``; the defaults a
task fills into the config -- max_new_tokens, reward, tools -- are its row of
``config.BUILTIN_TASKS``). ``rldsl run`` without ``--data`` reads its task here; nothing else
names a task.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import BUILTIN_TASKS, DataConfig, RunConfig
from ..data.reasoning_gym import is_reasoning_gym
from ..errors import ConfigError
from .basic_arithmetic import embedded_model as arithmetic_model
from .builtin import BuiltinTask
from .tool_warmup import CALCULATOR
from .warmup import ADDITION

TASKS: dict[str, BuiltinTask] = {t.name: t for t in (ADDITION, CALCULATOR)}
assert set(TASKS) == set(BUILTIN_TASKS), "a built-in task needs a row in both tables"


def builtin_task(cfg: RunConfig) -> BuiltinTask | None:
    """The run's built-in task (``data.task``), None when it reads a data file."""
    return None if cfg.builtin_task is None else TASKS[cfg.builtin_task.name]


def embedded_model(cfg: RunConfig) -> tuple[Path, str]:
    """(model folder, label) of a run without ``model.path``: its built-in task's embedded model,
    warm-started on first use; reasoning-gym data the embedded arithmetic model warm-started on
    that data (toy/basic_arithmetic.py); another data file trains the default task's (the toy)."""
    if is_reasoning_gym(cfg.data.path):
        return (arithmetic_model(cfg.data.path, cfg.data.options, cfg.seed, cfg.reward.answer_format, verbose=True),
                "embedded arithmetic model (warm-started)")
    task = builtin_task(cfg) or TASKS[DataConfig().task]
    return task.model(cfg.rollout.engine == "vllm")


def check_builtin_task(cfg: RunConfig, tokenizer: Any) -> None:
    """A user's model (``model.path``) with no ``data.path`` would train on the built-in task
    (``data.task``: the embedded model's toy arithmetic, written in its character vocabulary):
    refused with a ConfigError naming data.path, unless ``data.task`` is set explicitly or the model
    has the embedded model's tokenizer (a copy of the toy, as the tests' models are)."""
    task = builtin_task(cfg)
    if cfg.model.path is None or task is None or "task" in cfg.data.model_fields_set:
        return
    if tokenizer.get_vocab() == task.tokenizer().get_vocab():
        return
    raise ConfigError(f"data.path is not set: the model {cfg.model.path} would train on the built-in "
                      f"'{cfg.data.task}' task, the embedded toy model's arithmetic. Give your prompts with "
                      f"--data FILE (data.path), or --set data.task={cfg.data.task} to train on the built-in "
                      f"task anyway")
