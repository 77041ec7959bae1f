"""A reward worker process of :class:`~rldsl.runtime.rewards.deadline.DeadlinePool`:
``python -m rldsl.runtime.rewards.reward_worker READ_FD WRITE_FD``.

The pool's first message is ``("config", sys_path, files, names)``: the run's import path, the
files it loaded by path (runtime/plugins.py, loaded again under the same module names) and the
spec's per-sample terms, which this process loads by name as the run did (:func:`reward_term`)
before it says ``("ready",)`` -- or ``("failed", why)``. Then it reads ``(term, rows)``, a few
calls of one term, each row ``(prompt, completion, answer, finish_reason)``, and answers each
call as it ends, in order: ``("ok", value)`` or ``("error", type name, message, the pickled
exception or None)``. Ctrl-C and SIGTERM are the run's to handle: this process ignores them
(the pool kills it when a call is interrupted), and it exits when the pool's pipe closes or the
run's process is gone.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from .. import plugins
from .functions import exit_error, reward_term


def _error(e: BaseException) -> tuple:
    """What the pool gets of an exception: its type name, message and (if it pickles) itself."""
    if isinstance(e, SystemExit):  # the function's sys.exit(): its error, not this process's end
        e = exit_error(e)
    try:
        pickled: bytes | None = pickle.dumps(e)
    except Exception:  # noqa: BLE001 - an exception holding something that does not pickle
        pickled = None
    return ("error", type(e).__name__, str(e), pickled)


def _exit_with_the_pool(parent: int) -> None:
    """End this process when the run's process is gone (SIGKILLed: nobody kills this one, and a
    call that hangs would never read the closed pipe). A thread, not PR_SET_PDEATHSIG: that fires
    when the spawning *thread* ends, and the run spawns from threads that come and go."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def serve(inbox: Connection, outbox: Connection) -> None:
    """The process's life (module docstring)."""
    for stop in (signal.SIGINT, signal.SIGTERM):  # sent to the whole process group: the run's to handle
        signal.signal(stop, signal.SIG_IGN)       # (it finishes the step in hand, scored here, then exits)
    threading.Thread(target=_exit_with_the_pool, args=(os.getppid(),), daemon=True).start()
    _, sys_path, files, names = inbox.recv()
    sys.path[:] = sys_path
    try:
        plugins.load_files(files)
        terms = [reward_term(name) for name in names]
    except BaseException as e:  # noqa: BLE001 - said to the pool, which fails the calls with it
        outbox.send(("failed", f"{type(e).__name__}: {e}"))
        return
    outbox.send(("ready",))
    while True:
        try:
            term, rows = inbox.recv()
        except (EOFError, OSError):  # the pool closed
            return
        for prompt, completion, answer, finish_reason in rows:  # each answered as it ends
            try:
                said = ("ok", terms[term](prompt, completion, answer, finish_reason))
            except BaseException as e:  # noqa: BLE001 - the sample's error, the pool's to report
                said = _error(e)
            outbox.send(said)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
