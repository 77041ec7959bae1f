"""A worker process on two pipes: the one way the runtime runs user code that it may have to stop.

A Python thread cannot be stopped; a process can. The reward's calls under ``reward.timeout_s``
(rewards/deadline.py) and the tools' calls under ``rollout.tool_timeout_s``
(rollout/episodes/tools.py) each run in worker processes that this module starts: the worker is
given the read end of one pipe and the write end of another as its two last arguments, is sent
its configuration first (the run's import path, the files the run loaded by path, ...: what it
needs to load the user's code as the run did), and is killed -- never asked -- when a call runs
past its limit. What the pools do with a worker (calls, limits, replacements) stays theirs.
"""
from __future__ import annotations

import os
import subprocess
import time
from multiprocessing import connection
from typing import Any

#: How long :meth:`WorkerProcess.exit_code` waits for a process that was killed or has closed its
#: pipe to be reaped, before it says the code is unknown (None).
REAP_S = 5.0


class WorkerProcess:
    """A started worker (``command`` plus its two pipe ends), and the parent's ends of its pipes:
    ``outbox`` (what the worker reads) and ``conn`` (what it says). ``config`` is its first
    message; a worker that exited already has a closed pipe, and :attr:`conn` says so when read.
    ``since``: when it was started (the pools move it on as their calls start)."""

    def __init__(self, command: list[str], config: Any) -> None:
        worker_in, parent_out = os.pipe()  # (read end, write end)
        parent_in, worker_out = os.pipe()
        self.process = subprocess.Popen([*command, str(worker_in), str(worker_out)],
                                        pass_fds=(worker_in, worker_out), stdin=subprocess.DEVNULL)
        os.close(worker_in)
        os.close(worker_out)
        self.outbox = connection.Connection(parent_out, readable=False)
        self.conn = connection.Connection(parent_in, writable=False)
        try:
            self.outbox.send(config)
        except OSError:  # it exited already: its pipe says so
            pass
        self.since = time.monotonic()

    def exit_code(self) -> int | None:
        """The process's exit code (it is reaped), or None when it has not exited within :data:`REAP_S`."""
        try:
            return self.process.wait(timeout=REAP_S)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Stop the process (when still running), reap it and close both pipes."""
        if self.process.poll() is None:
            self.process.kill()
        self.exit_code()
        self.outbox.close()
        self.conn.close()
