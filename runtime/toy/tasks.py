"""The built-in tasks' prompts and embedded models, one row per ``data.task`` (the defaults a
task fills into the config -- max_new_tokens, reward, tools -- are its row of
``config.BUILTIN_TASKS``). ``rldsl run`` without ``--data`` reads its task here; nothing else
names a task.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from ..config import BUILTIN_TASKS, DataConfig, RunConfig
from ..data.datasets import Example, PromptSource
from ..data.reasoning_gym import is_reasoning_gym
from .basic_arithmetic import embedded_model as arithmetic_model
from .calculator import SumTask
from .model import vllm_variant_config
from .task import AdditionTask
from .tool_model import tool_model_config
from .tool_warmup import tool_warm_start
from .warmup import warm_start


class TaskPrompts(Protocol):
    """A built-in task's prompts: a fixed held-out split, and a training source seeded per run."""

    def heldout_examples(self) -> list[Example]: ...

    def prompt_source(self, seed: int) -> PromptSource: ...


@dataclass(frozen=True)
class BuiltinTask:
    """``prompts()``: the task; ``model(vllm)``: (the warm-started model folder, a label),
    the head-dim-32 variant when ``vllm`` (vLLM's CPU attention refuses head dim 24)."""

    name: str
    prompts: Callable[[], TaskPrompts]
    model: Callable[[bool], tuple[Path, str]]


def _toy_model(vllm: bool) -> tuple[Path, str]:
    if vllm:
        return (Path(warm_start(model_config=vllm_variant_config(), verbose=True)),
                "embedded toy model, head-dim-32 variant for vLLM (warm-started)")
    return Path(warm_start(verbose=True)), "embedded toy model (warm-started)"


def _tool_model(vllm: bool) -> tuple[Path, str]:
    if vllm:  # head dim 32, as the toy's vLLM variant
        return (Path(tool_warm_start(model_config=tool_model_config(num_attention_heads=3), verbose=True)),
                "embedded tool-use model, head-dim-32 variant for vLLM (warm-started)")
    return Path(tool_warm_start(verbose=True)), "embedded tool-use model (warm-started)"


TASKS: dict[str, BuiltinTask] = {t.name: t for t in (
    BuiltinTask("addition", AdditionTask, _toy_model),
    BuiltinTask("calculator", SumTask, _tool_model),
)}
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
