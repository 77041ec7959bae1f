"""Per-sample reward calls under a wall-clock limit (``reward.timeout_s``), in worker processes.

A Python thread cannot be stopped, and ``math_verify``'s own limit (SIGALRM) works only in a
process's main thread: a reward called from the run's reward threads, a Ray rollout worker or
``serve-reward``'s request threads had no limit at all (nested ``\\frac{`` costs the ``math``
verifier ~14 s per 10 KB of completion). A process can be stopped: each call runs in one of the
pool's processes (``reward_worker.py``, which loads the spec's terms by name as the run did), and
a call past the limit has its process killed -- the sample's value is a :class:`RewardTimeout`,
the other samples are scored, and the next call gets a fresh process. A call's limit counts from
when it is sent to a ready process (a process's start-up is not counted: :data:`START_LIMIT_S`).

What it costs on the normal path: one round trip through a pipe per call (docs/rewards.md has
the figures); the processes start once, on first use, and are reused across calls and steps.
"""
from __future__ import annotations

import atexit
import os
import pickle
import sys
import threading
import time
import weakref
from multiprocessing import connection

from .. import plugins
from ..errors import RewardTimeout, RewardWorkerError
from ..processes import WorkerProcess

#: How long a worker process may take to start and load the reward's terms (importing the user's
#: module) before it is given up; the calls' own limit counts from when each is sent.
START_LIMIT_S = 120.0

#: The longest single wait on the pipes (a longer limit waits again): poll(2) takes at most
#: 2^31 - 1 ms, and a limit of years would be an OverflowError in the wait.
MAX_WAIT_S = 3600.0

#: The worker's module, run as ``python -m`` (the language package's import path).
WORKER_MODULE = "rldsl.runtime.rewards.reward_worker"


def remote_error(kind: str, message: str, pickled: bytes | None) -> BaseException:
    """The exception a call raised in its process: the same object when it travels (pickled),
    else an exception of the same type name and message."""
    if pickled is not None:
        try:
            error = pickle.loads(pickled)
            if isinstance(error, BaseException):
                return error
        except Exception:  # noqa: BLE001 - a class this process cannot import: rebuilt by name below
            pass
    return type(kind, (Exception,), {})(message)


#: Most calls sent to a process at once: it runs them one after another and answers each as it
#: ends, so it never waits for the pool between calls (a call's limit counts from the previous
#: one's answer); small enough that the processes share a batch's calls evenly.
CHUNK = 16


class _Process(WorkerProcess):
    """One worker process (``reward_worker.py``) and its pipes (runtime/processes.py); ``jobs``: the
    calls sent to it and not answered yet (indices; the first one is running), empty when idle;
    ``since``: when it was started (not ready yet), or when its running call started (sent, or
    the previous one answered)."""

    def __init__(self, names: list[str]) -> None:
        # the run's import path (absolute) and the files it loaded by path: the terms load as here
        super().__init__([sys.executable, "-m", WORKER_MODULE],
                         ("config", [os.path.abspath(p) for p in sys.path], plugins.loaded_files(), names))
        self.ready = False
        self.jobs: list[int] = []


class DeadlinePool:
    """``workers`` processes that call the per-sample terms ``names`` (reward spec terms, loaded
    by name in each process), each call under ``timeout_s`` seconds of wall clock. Thread-safe:
    concurrent :meth:`run` calls (``serve-reward``'s requests) each take processes of their own
    (idle ones first); at most ``workers`` idle ones are kept between calls."""

    def __init__(self, names: list[str], *, workers: int, timeout_s: float) -> None:
        self.names, self.workers, self.timeout_s = list(names), workers, timeout_s
        self._idle: list[_Process] = []
        self._lock = threading.Lock()
        _POOLS.add(self)

    def run(self, term: int, rows: list[tuple[str, str, str, str]]) -> list[float | BaseException]:
        """Term ``term``'s value for each (prompt, completion, answer, finish_reason), or the
        exception of its call: the function's own, a :class:`RewardTimeout`, a :class:`RewardWorkerError`."""
        results: list[float | BaseException | None] = [None] * len(rows)
        waiting = list(range(len(rows)))[::-1]  # popped from the end: the first row first
        want = min(self.workers, len(rows))
        mine = self._take(want)
        try:
            while waiting or any(p.jobs for p in mine):
                while waiting and len(mine) < want:  # a killed process's place
                    mine.append(_Process(self.names))
                self._send(term, rows, mine, waiting)
                now = time.monotonic()
                due = [p.since + (self.timeout_s if p.ready else START_LIMIT_S) - now
                       for p in mine if p.jobs or not p.ready]
                wait_s = min(max(0.0, min(due, default=0.0)), MAX_WAIT_S)
                for conn in connection.wait([p.conn for p in mine], timeout=wait_s):
                    self._read(next(p for p in mine if p.conn is conn), mine, results, waiting)
                self._enforce(mine, results, waiting)
        finally:  # an interrupt (Ctrl-C) mid-call: a busy process's answer would reach the next call
            for p in [p for p in mine if p.jobs]:
                p.kill()
                mine.remove(p)
            self._give_back(mine)
        return [r if r is not None else RewardWorkerError("the reward was not computed") for r in results]

    def _send(self, term: int, rows: list[tuple[str, str, str, str]], mine: list[_Process],
              waiting: list[int]) -> None:
        idle = [p for p in mine if p.ready and not p.jobs]
        for p in idle:
            size = min(CHUNK, -(-len(waiting) // len(idle)))  # the calls left, shared evenly
            p.jobs, p.since = [waiting.pop() for _ in range(min(size, len(waiting)))], time.monotonic()
            if p.jobs:
                try:
                    p.outbox.send((term, [rows[i] for i in p.jobs]))
                except OSError:  # it died: its pipe says so
                    pass

    def _read(self, p: _Process, mine: list[_Process], results: list, waiting: list[int]) -> None:
        try:
            message = p.conn.recv()
        except (EOFError, OSError):  # the process died
            why = f"the reward's worker process died (exit code {p.exit_code()})"
            if p.ready:
                self._drop(p, mine, results, waiting, RewardWorkerError(why))
            else:  # it could not start: another would not either
                self._failed_start(p, mine, results, waiting, why)
            return
        if message[0] == "ready":
            p.ready, p.since = True, time.monotonic()
        elif message[0] == "failed":  # the terms did not load there
            self._failed_start(p, mine, results, waiting, f"the reward's worker process could not load it "
                                                          f"({message[1]}); reward.timeout_s=0 calls it in the run's process")
        else:  # ("ok", value) or ("error", type name, message, pickled or None): the first call's
            results[p.jobs.pop(0)] = message[1] if message[0] == "ok" else remote_error(*message[1:])
            p.since = time.monotonic()  # the next call starts now

    def _enforce(self, mine: list[_Process], results: list, waiting: list[int]) -> None:
        now = time.monotonic()
        for p in list(mine):
            if p.ready and p.jobs and now - p.since >= self.timeout_s:
                self._drop(p, mine, results, waiting, RewardTimeout(
                    f"the reward took longer than {self.timeout_s:g} s (reward.timeout_s); its process was stopped"))
            elif not p.ready and now - p.since >= START_LIMIT_S:
                self._failed_start(p, mine, results, waiting,
                                   f"the reward's worker process did not start within {START_LIMIT_S:g} s")

    def _drop(self, p: _Process, mine: list[_Process], results: list, waiting: list[int],
              error: BaseException) -> None:
        """Kill one process; its running call (if any) gets ``error``, the calls sent after it wait
        for another process. The other processes are not touched."""
        if p.jobs:
            results[p.jobs[0]] = error
            waiting += p.jobs[:0:-1]  # popped from the end: in their order
        p.kill()
        mine.remove(p)

    def _failed_start(self, p: _Process, mine: list[_Process], results: list, waiting: list[int], why: str) -> None:
        """A process that never got ready: every call still waiting gets the error (a new process
        would fail the same way)."""
        self._drop(p, mine, results, waiting, RewardWorkerError(why))
        for i in waiting:
            results[i] = RewardWorkerError(why)
        waiting.clear()

    def _take(self, want: int) -> list[_Process]:
        with self._lock:
            mine, self._idle = self._idle[:want], self._idle[want:]
        return mine

    def _give_back(self, processes: list[_Process]) -> None:
        with self._lock:
            self._idle += processes
            extra, self._idle = self._idle[self.workers:], self._idle[:self.workers]
        for p in extra:
            p.kill()

    def close(self) -> None:
        """Stop the idle processes (a later :meth:`run` starts new ones)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for p in idle:
            p.kill()


_POOLS: weakref.WeakSet[DeadlinePool] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # before the interpreter tears down: no orphaned worker
    for pool in list(_POOLS):
        pool.close()
