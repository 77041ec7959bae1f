"""Environments: ``reset(row) -> messages``, ``step(assistant_message) -> StepResult``.
``ToolEnv``, the default one, runs the model's tool calls and returns their results."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from .parsers import ToolCall, ToolCallError, parse_tool_calls
from .tools import SHARED_RUNNER, ToolRunner


@dataclass
class StepResult:
    """What an environment answers to an assistant message."""

    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict) -> list[dict]: ...

    def step(self, assistant_message: dict) -> StepResult: ...


class ToolEnv:
    """reset: the row's prompt as a user message (after its ``system`` message, if any);
    step: no tool call -> done; else each call (at most ``max_tool_calls``) runs and its result
    comes back as a ``tool`` message."""

    def __init__(self, tools: list[Callable], parser: str = "hermes", max_tool_calls: int = 4,
                 timeout_s: float = 10.0, max_output_chars: int = 1000, runner: ToolRunner | None = None):
        self.tools = list(tools)
        self.by_name = {t.__name__: t for t in self.tools}
        self.parser = parser
        self.max_tool_calls = max_tool_calls
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.runner = runner if runner is not None else SHARED_RUNNER

    def reset(self, row: dict) -> list[dict]:
        system = row.get("system")
        return ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message: dict) -> StepResult:
        calls = parse_tool_calls(self.parser, assistant_message.get("content") or "")
        if not calls:
            return StepResult(done=True)
        texts: list[str | None] = []
        jobs = []
        for i, c in enumerate(calls):
            if i >= self.max_tool_calls:
                texts.append(f"error: at most {self.max_tool_calls} tool calls per turn")
            elif isinstance(c, ToolCallError):
                texts.append(c.message)
            elif c.name not in self.by_name:
                texts.append(f"error: unknown tool {c.name!r}; the tools are {sorted(self.by_name)}")
            else:
                texts.append(None)
                jobs.append((self.by_name[c.name], c.arguments))
        results = iter(self.runner.run_many(jobs, timeout_s=self.timeout_s,
                                            max_output_chars=self.max_output_chars) if jobs else [])
        names = [c.name if isinstance(c, ToolCall) else "error" for c in calls]
        return StepResult([{"role": "tool", "name": n, "content": t if t is not None else next(results)}
                           for n, t in zip(names, texts)])
