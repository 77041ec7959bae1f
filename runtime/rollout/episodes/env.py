"""Environments: ``reset(row) -> messages``, ``step(assistant_message) -> StepResult``.
``ToolEnv``, the default one, runs the model's tool calls and returns their results."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from ... import plugins
from ...errors import ConfigError, EnvironmentFailed
from ...rewards.values import reward_value

from .parsers import ToolCall, ToolCallError, parse_tool_calls
from .tools import SHARED_TOOL_POOL, ToolResult, ToolPool


@dataclass
class StepResult:
    """What an environment answers to an assistant message."""

    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """One episode's world. ``reset(row)``: the first messages (the row has ``prompt`` and
    ``answer``); the instance may set ``tools`` (functions the chat template renders).
    ``step(assistant_message)``: a :class:`StepResult` or a tuple ``(messages, reward, done)``."""

    def reset(self, row: dict) -> list[dict]: ...

    def step(self, assistant_message: dict) -> StepResult: ...


def load_env(spec: str) -> type:
    """``module:Class`` (or ``path/to/file.py:Class``) -> the environment class: importable, a
    class, with ``reset`` and ``step``, constructible without arguments."""
    cls = plugins.load_object(spec, plugins.ENVIRONMENT)
    if not inspect.isclass(cls):
        raise ConfigError(f"environment {spec!r} is not a class (got {type(cls).__name__})")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"environment {spec!r} has no {' and no '.join(missing)} method "
                          "(reset(row) -> messages, step(assistant_message) -> (messages, reward, done))")
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise ConfigError(f"environment {spec!r} must be constructible without arguments "
                          f"(its __init__ takes {inspect.signature(cls)})") from None
    return cls


def env_reset(env: Any, row: dict) -> list[dict]:
    """``env.reset(row)``, its failure a clear :class:`EnvironmentFailed`."""
    try:
        messages = env.reset(row)
    except Exception as e:
        raise EnvironmentFailed(f"environment {type(env).__name__}.reset raised {type(e).__name__}: {e}") from e
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise EnvironmentFailed(f"environment {type(env).__name__}.reset must return a list of messages "
                                f"({{'role': ..., 'content': ...}}), got {messages!r:.200}")
    return messages


def env_step(env: Any, message: dict) -> StepResult:
    """``env.step(message)`` as a :class:`StepResult` (a ``(messages, reward, done)`` tuple is
    accepted), its failure a clear :class:`EnvironmentFailed`."""
    name = type(env).__name__
    try:
        result = env.step(message)
    except EnvironmentFailed:
        raise
    except Exception as e:
        raise EnvironmentFailed(f"environment {name}.step raised {type(e).__name__}: {e}") from e
    if isinstance(result, tuple) and len(result) == 3:
        result = StepResult(list(result[0] or []), result[1], bool(result[2]))
    if not isinstance(result, StepResult):
        raise EnvironmentFailed(f"environment {name}.step must return (messages, reward, done) or a "
                                f"StepResult, got {result!r:.200}")
    if result.reward is not None:
        try:
            result.reward = reward_value(result.reward, f"environment {name}.step")  # the one check
        except ValueError as e:
            raise EnvironmentFailed(f"{e} (a step's reward is a number, or None for none)") from None
    if not all(isinstance(m, dict) and "role" in m for m in result.messages):
        raise EnvironmentFailed(f"environment {name}.step returned messages that are not "
                                f"{{'role': ..., 'content': ...}} dicts: {result.messages!r:.200}")
    return result


def _tool_message(name: str, result: str | ToolResult) -> dict:
    """A ``tool`` message: the result's text; what the tool printed, if anything, under
    ``output`` (kept in samples.jsonl; chat templates do not render it)."""
    if isinstance(result, str):
        return {"role": "tool", "name": name, "content": result}
    message = {"role": "tool", "name": name, "content": result.text}
    return {**message, "output": result.output} if result.output else message


class ToolEnv:
    """reset: the row's prompt -- a string as a user message, a messages list as it is --
    after the row's ``system`` message (``data.system_prompt``) unless the messages have one;
    step: no tool call -> done; else each call (at most ``max_tool_calls``) runs and its result
    comes back as a ``tool`` message."""

    def __init__(self, tools: list[Callable], parser: str = "hermes", max_tool_calls: int = 4,
                 timeout_s: float = 10.0, max_output_chars: int = 1000, pool: ToolPool | None = None):
        self.tools = list(tools)
        self.by_name = {t.__name__: t for t in self.tools}
        self.parser = parser
        self.max_tool_calls = max_tool_calls
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.pool = pool if pool is not None else SHARED_TOOL_POOL

    def reset(self, row: dict) -> list[dict]:
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        system = row.get("system")
        if system and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": system})
        return messages

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
        results = iter(self.pool.run_calls(jobs, timeout_s=self.timeout_s,
                                             max_output_chars=self.max_output_chars) if jobs else [])
        names = [c.name if isinstance(c, ToolCall) else "error" for c in calls]
        return StepResult([_tool_message(n, t if t is not None else next(results)) for n, t in zip(names, texts)])
