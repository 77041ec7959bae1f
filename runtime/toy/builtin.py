"""What a built-in task (``data.task``) gives a run: its prompts, its embedded model and that
model's tokenizer. Each task's warm-start module declares its own (toy/warmup.py ``ADDITION``,
toy/tool_warmup.py ``CALCULATOR``); toy/tasks.py tables them by name."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from ..data.datasets import Example, PromptSource


class TaskPrompts(Protocol):
    """A built-in task's prompts (toy/task.py ``AdditionTask``, toy/calculator.py ``SumTask``)."""

    def heldout_examples(self) -> list[Example]: ...

    def prompt_source(self, seed: int) -> PromptSource: ...


@dataclass(frozen=True)
class BuiltinTask:
    """``prompts()``: the task; ``model(vllm)``: (the warm-started model folder, a label),
    the head-dim-32 variant when ``vllm`` (vLLM's CPU attention refuses head dim 24);
    ``tokenizer()``: the embedded model's tokenizer (the task's prompts are written in its vocabulary)."""

    name: str
    prompts: Callable[[], TaskPrompts]
    model: Callable[[bool], tuple[Path, str]]
    tokenizer: Callable[[], Any]
