"""The built-in tasks (``data.task``, when ``data.path`` is null) in the table of prompt sources
(data/sources.py): each task's prompts, default reward, tools and ``max_new_tokens``, and the
embedded model a run without ``model.path`` trains; and the embedded arithmetic model that
reasoning-gym data without ``model.path`` trains. The prompts are cheap (toy/task.py,
toy/calculator.py); the models (torch, transformers) load only when a run builds one.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ..config import (ADDITION_TASK, CALCULATOR_MAX_NEW_TOKENS, CALCULATOR_TASK, TOY_MAX_NEW_TOKENS,
                      RunConfig)
from ..data import reasoning_gym as rg
from ..data.sources import Rows, Source, heldout_count
from .calculator import SumTask
from .task import AdditionTask


def _task_rows(task: Callable[[], Any]) -> Callable[[RunConfig], Rows]:
    def rows(cfg: RunConfig) -> Rows:
        t = task()
        prompts = t.prompt_source(cfg.seed)
        size = heldout_count(cfg)
        return Rows(list(prompts.examples), t.heldout_examples()[:size] if size else [], data=prompts)
    return rows


def _task_prompts(cfg: RunConfig, rows: Rows, train: list[Any], held: list[Any], render: Any) -> Any:
    return rows.data  # the task's own prompt source, in its model's format (never rendered)


def _addition_model(cfg: RunConfig) -> tuple[Path, str]:
    from .warmup import embedded_model
    return embedded_model(cfg.rollout.engine == "vllm")


def _addition_tokenizer() -> Any:
    from .warmup import embedded_tokenizer
    return embedded_tokenizer()


def _calculator_model(cfg: RunConfig) -> tuple[Path, str]:
    from .tool_warmup import embedded_model
    return embedded_model(cfg.rollout.engine == "vllm")


def _calculator_tokenizer() -> Any:
    from .tool_warmup import embedded_tokenizer
    return embedded_tokenizer()


def _arithmetic_model(cfg: RunConfig) -> tuple[Path, str]:
    from .basic_arithmetic import embedded_model
    return (embedded_model(cfg.data.path, cfg.data.options, cfg.seed, cfg.reward.answer_format, verbose=True),
            "embedded arithmetic model (warm-started)")


def builtin_task(name: str, task: Callable[[], Any], *, reward: str, max_new_tokens: int,
                 model: Callable[[RunConfig], tuple[Path, str]], tokenizer: Callable[[], Any],
                 tools: str | None = None) -> Source:
    """The row of a built-in task ``name``: ``task()`` gives its prompts (``prompt_source(seed)``,
    ``heldout_examples()``: toy/task.py ``AdditionTask``)."""
    return Source(name, f"the built-in {name} task",
                  claims=lambda cfg: cfg.data.path is None and cfg.data.task == name,
                  rows=_task_rows(task), prompts=_task_prompts, reward=reward, max_new_tokens=max_new_tokens,
                  tools=tools, rendered=False, model=model, tokenizer=tokenizer)


#: 2-digit addition (the default), scored by exactly the answer, then EOS
ADDITION = builtin_task(ADDITION_TASK, AdditionTask, reward="addition", max_new_tokens=TOY_MAX_NEW_TOKENS,
                        model=_addition_model, tokenizer=_addition_tokenizer)
#: sums of three numbers with a calculator tool; the episode's final message scored as addition's
CALCULATOR = builtin_task(CALCULATOR_TASK, SumTask, reward="addition",
                          max_new_tokens=CALCULATOR_MAX_NEW_TOKENS, model=_calculator_model,
                          tokenizer=_calculator_tokenizer, tools="rldsl.runtime.toy.calculator:calculator")
#: reasoning-gym data trains the embedded arithmetic model warm-started on it (toy/basic_arithmetic.py)
REASONING_GYM = replace(rg.SOURCE, model=_arithmetic_model)
