"""Tools: plain Python functions, described by their type hints and docstring, run in worker
processes (a bounded pool, ``rollout.tool_workers``) with a wall-clock limit per call; their
result (or error) is the text the model sees, what they print is captured and cut."""
from __future__ import annotations

import atexit
import os
import pickle
import sys
import time
from dataclasses import dataclass
from multiprocessing import connection
from typing import Callable

from ... import plugins
from ...errors import ConfigError
from ...processes import WorkerProcess
from . import tool_worker


def load_tools(spec: str) -> list[Callable]:
    """``"module:function[,module:function]"`` (or ``path/to/file.py:function``, the rules of
    runtime/plugins.py) -> the functions (a clear error when one does not import, is missing or
    cannot be described)."""
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        fn = plugins.load_function(part, plugins.TOOL)
        tool_schema(fn)
        out.append(fn)
    return out


def tool_schema(fn: Callable) -> dict:
    """The JSON schema of ``fn`` from its type hints and Google-style docstring."""
    from transformers.utils import get_json_schema  # transformers: imported when a run has tools

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers raises its own TypeError subclasses
        raise ConfigError(f"tool {getattr(fn, '__name__', fn)!r} cannot be described: {e}") from None


#: How long a worker may take to start (interpreter, sandbox) and to read a call (importing the
#: tool's module) before the call starts; the call's own limit counts from then.
START_LIMIT_S = 120.0


@dataclass
class ToolResult:
    """One call's outcome: ``text`` (the result, or the error, the model reads) and ``output``
    (what the tool printed to stdout/stderr), each cut to the call's ``max_output_chars``."""

    text: str
    output: str = ""


class _Worker(WorkerProcess):
    """One worker process (``tool_worker.py``, run as a script) and its pipes (runtime/processes.py);
    ``job``: the call it runs (an index), None when idle; ``since``: when it was spawned (not
    ready yet), was sent its call (not started yet) or started its call."""

    def __init__(self, hidden: tuple[str, ...], python: str) -> None:
        # the run's import path, absolute: the worker works in a folder of its own
        super().__init__([python, tool_worker.__file__],
                         ("config", [os.path.abspath(p) for p in sys.path], list(hidden), plugins.loaded_files()))
        self.ready = False
        self.job: int | None = None
        self.started = False


class ToolPool:
    """A bounded pool of spawned worker processes, each running one call at a time.

    ``run_many`` runs its calls ``workers`` at a time. Each call's wall-clock limit counts from
    when it starts running in its worker (its "start" message): a worker's start-up and the
    wait for a free worker are not counted. A call past its limit has its worker killed (and
    replaced when calls remain); the other calls, running or waiting, are not touched. Workers
    are started on first use and reused across calls and batches.
    """

    def __init__(self, workers: int = 1, hidden: tuple[str, ...] = ()):
        self.workers = workers
        self.hidden = tuple(hidden)  # folders the tools cannot see (the run's)
        self.python = sys.executable  # the workers' interpreter
        self._pool: list[_Worker] = []

    def hide(self, *folders: str | os.PathLike) -> None:
        """Hide these folders from the tool processes too (they restart with it)."""
        hidden = tuple(dict.fromkeys((*self.hidden, *(os.path.abspath(f) for f in folders))))
        if hidden != self.hidden:
            self.hidden = hidden
            self.close()

    def resize(self, workers: int) -> None:
        """At most ``workers`` processes from now on (extra idle ones stop)."""
        self.workers = workers
        while len(self._pool) > workers:
            self._pool.pop().kill()

    def run_many(self, calls: list[tuple[Callable, dict]], *, timeout_s: float,
                 max_output_chars: int) -> list[str]:
        """The text result of each (function, arguments)."""
        return [r.text for r in self.run_calls(calls, timeout_s=timeout_s, max_output_chars=max_output_chars)]

    def run_calls(self, calls: list[tuple[Callable, dict]], *, timeout_s: float,
                  max_output_chars: int) -> list[ToolResult]:
        """Each call's :class:`ToolResult`, in order."""
        results: list[ToolResult | None] = [None] * len(calls)
        waiting = list(range(len(calls)))[::-1]  # popped from the end: first call first
        while waiting or any(w.job is not None for w in self._pool):
            while waiting and len(self._pool) < self.workers and \
                    len(self._pool) < sum(w.job is not None for w in self._pool) + len(waiting):
                self._pool.append(_Worker(self.hidden, self.python))
            for w in self._pool:
                if w.ready and w.job is None and waiting:
                    i = waiting.pop()
                    fn, arguments = calls[i]
                    try:
                        data = pickle.dumps((fn, arguments, max_output_chars))
                    except Exception as e:  # e.g. a function defined inside another one
                        results[i] = ToolResult("error: the tool cannot be sent to its process "
                                                f"({type(e).__name__}: {e})")
                        continue
                    w.job, w.started, w.since = i, False, time.monotonic()
                    try:
                        w.outbox.send_bytes(data)
                    except OSError:  # it died: its pipe says so below
                        pass
            now = time.monotonic()
            due = [w.since + (timeout_s if w.started else START_LIMIT_S) - now
                   for w in self._pool if w.job is not None or not w.ready]
            for conn in connection.wait([w.conn for w in self._pool], timeout=max(0.0, min(due, default=0.0))):
                w = next(w for w in self._pool if w.conn is conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # the process died
                    if w.ready:
                        self._drop(w, results, f"error: the tool's process died (exit code {w.exit_code()})")
                    else:  # it could not start: another would not either
                        self._failed_start(w, results, waiting, "error: the tool's process could not start "
                                                                f"(exit code {w.exit_code()})")
                    continue
                if message[0] == "ready":
                    w.ready, w.since = True, time.monotonic()
                elif message[0] == "start":
                    w.started, w.since = True, time.monotonic()
                else:  # ("done", text, output)
                    results[w.job] = ToolResult(message[1], message[2])  # type: ignore[index]
                    w.job = None
            now = time.monotonic()
            for w in list(self._pool):
                if w.started and w.job is not None and now - w.since >= timeout_s:
                    self._drop(w, results, f"error: the tool took longer than {timeout_s:g} s")
                elif not w.ready and now - w.since >= START_LIMIT_S:
                    self._failed_start(w, results, waiting,
                                       f"error: the tool's process did not start within {START_LIMIT_S:g} s")
                elif w.job is not None and not w.started and now - w.since >= START_LIMIT_S:
                    self._drop(w, results, f"error: the tool was not loaded within {START_LIMIT_S:g} s")
        return [r if r is not None else ToolResult("error: the tool did not run") for r in results]

    def _drop(self, w: _Worker, results: list[ToolResult | None], text: str) -> None:
        """Kill one worker; its call (if any) gets ``text``. The other workers are not touched."""
        if w.job is not None:
            results[w.job] = ToolResult(text)
        w.kill()
        self._pool.remove(w)

    def _failed_start(self, w: _Worker, results: list[ToolResult | None], waiting: list[int], text: str) -> None:
        """A worker that never got ready: the calls still waiting get ``text`` (a new worker
        would fail the same way); the running ones are not touched."""
        for i in waiting:
            results[i] = ToolResult(text)
        waiting.clear()
        self._drop(w, results, text)

    def close(self) -> None:
        for w in self._pool:
            w.kill()
        self._pool = []


SHARED_TOOL_POOL = ToolPool()
atexit.register(SHARED_TOOL_POOL.close)  # stop the pool before the interpreter tears down


def run_tool(fn: Callable, arguments: dict, *, timeout_s: float, max_output_chars: int) -> str:
    """One call in a separate process (module docstring)."""
    return SHARED_TOOL_POOL.run_many([(fn, arguments)], timeout_s=timeout_s, max_output_chars=max_output_chars)[0]
