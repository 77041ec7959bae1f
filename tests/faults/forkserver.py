"""A fork server for the fault suite: one interpreter that has imported torch, transformers and the
runtime once, and forks a fresh `rldsl` process for each run the suite starts.

Every run the suite kills is a process of its own, started from scratch, killed for real and
resumed by another; what an interpreter start costs (importing torch and transformers: 2 s of
CPU idle, 8 s on a loaded 2-core machine, ~25 times in the suite) is what forking from this
process saves. A forked run is the `rldsl` command of a fresh process in all that the suite checks:
its own pid, session and process group, its own environment, stdout, stderr and exit code, and the
interpreter's normal exit (threads joined, atexit handlers run) when it ends by itself.

Protocol (a JSON object a line on stdin, one answer a line on stdout):
  {"op": "spawn", "args": [...], "env": {...}, "cwd": "...", "out": FILE, "err": FILE} -> {"pid": N}
      (``err`` the same file as ``out``: both streams in it, in the order written)
  {"op": "wait", "pid": N, "timeout": SECONDS} -> {"code": C}: the exit code as subprocess gives it
      (-9 for a SIGKILL), or null while it still runs
End of stdin: every child still running is killed and the server exits. Only the server forks: it
starts no thread and runs no torch op before a fork, so a child inherits no lock held by another
thread and no thread pool it cannot use.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

#: what an `rldsl run` imports, loaded once here (the CLI itself imports them lazily)
PRELOAD = ("torch", "transformers.models.llama.modeling_llama", "rldsl.cli", "rldsl.runtime.cli",
           "rldsl.runtime.config", "rldsl.runtime.run.loop", "rldsl.runtime.run.build")


def serve(inp, out) -> dict | None:
    """Answer requests until stdin ends (returns None) or, in a forked child, return its request."""
    children: set[int] = set()
    for line in inp:
        req = json.loads(line)
        if req["op"] == "spawn":
            out.flush()
            pid = os.fork()
            if pid == 0:
                return req
            children.add(pid)
            answer = {"pid": pid}
        else:
            answer = {"code": _wait(req["pid"], req["timeout"])}
            if answer["code"] is not None:
                children.discard(req["pid"])
        out.write(json.dumps(answer) + "\n")
        out.flush()
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    return None


def _wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def child(req: dict) -> int:
    """In the forked process: become the `rldsl ARGS` command of a fresh process."""
    os.setsid()  # a session and process group of its own, as the suite's Popen gave it
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a foreground job
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        if fd == 2 and path == req["out"]:  # stderr into stdout, in the order written
            os.dup2(1, 2)
            continue
        new = os.open(path, flags, 0o644)
        os.dup2(new, fd)
        os.close(new)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.argv = ["rldsl", *req["args"]]
    from rldsl.cli import app
    try:
        app(args=req["args"], prog_name="rldsl")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    request = serve(sys.stdin, sys.stdout)
    sys.exit(0 if request is None else child(request))
