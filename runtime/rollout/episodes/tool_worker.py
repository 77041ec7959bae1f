"""A tool worker process, run as a script by ``tools.ToolPool``: standard library only, so it
starts in tens of milliseconds (it never imports rldsl, torch or transformers; a tool imports
what its own module needs when its first call is read).

``python tool_worker.py READ_FD WRITE_FD``: the runner's first message is ``("config",
sys_path, hidden, files)``; the worker takes the runner's ``sys.path`` (so the tools import as
they do in the run), loads the tool files the run loaded by path (``files``: module name ->
file, runtime/plugins.py) under the same module names, so a ``path/to/file.py:fn`` tool
unpickles here, sandboxes itself (``child_init``), sends what it prints (fds 1 and 2) to an
unnamed temporary file and says ``("ready",)``. Then, per call, it reads the pickled
``(fn, arguments, max_chars)``, says ``("start",)`` just before running it and answers
``("done", text, output)``: the result as the model's text (or the error) and what the call
printed, each cut to ``max_chars``.
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import pickle
import sys
import tempfile
from multiprocessing.connection import Connection
from typing import Any

TRUNCATED = "...[truncated]"

#: CLONE_NEWNET: a network namespace of its own (no interface but a down loopback); CLONE_NEWNS:
#: a mount namespace of its own (the run's folder hidden under an empty tmpfs)
_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
#: the largest file a tool may write (bytes), and no core dumps
_MAX_FILE_BYTES = 64 * 2**20


def _isolate(hidden: tuple[str, ...]) -> None:
    """No network, and ``hidden`` folders replaced by empty ones, in this process only -- where
    the OS allows it (Linux with the privilege, e.g. root in a container); otherwise nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    if libc.unshare(_CLONE_NEWNET | _CLONE_NEWNS) != 0:
        libc.unshare(_CLONE_NEWNET)  # at least the network, if mounts are not ours to change
        return
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return
    for folder in hidden:
        if os.path.isdir(folder):
            libc.mount(b"tmpfs", os.fsencode(folder), b"tmpfs", 0, b"size=1m,mode=0555")


def child_init(hidden: tuple[str, ...] = ()) -> None:
    """What every tool process does before its first call: no network and the run's folder
    hidden (namespaces of its own where the OS allows it; proxies cleared either way), a fresh
    empty working folder, bounded file writes, no core dumps."""
    _isolate(hidden)
    os.chdir(tempfile.mkdtemp(prefix="rldsl-tool-"))
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        os.environ.pop(var, None)
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (_MAX_FILE_BYTES, _MAX_FILE_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):  # not on this OS
        pass


def load_files(files: dict[str, str]) -> None:
    """Each ``module name -> file`` loaded under that name (before the sandbox hides anything)."""
    for name, path in files.items():
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception:  # its calls answer "the tool could not be loaded (...)"
            del sys.modules[name]


def as_text(value: Any) -> str:
    """A tool's return value as the model's text: a string as it is, else JSON, else ``str``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + TRUNCATED


def serve(inbox: Connection, outbox: Connection) -> None:
    """The worker's life (module docstring)."""
    _, sys_path, hidden, files = inbox.recv()
    sys.path[:] = sys_path  # not this script's folder: its modules would shadow the tools'
    load_files(files)
    child_init(tuple(hidden))
    capture = tempfile.TemporaryFile()  # not in the working folder: the tool sees it empty
    os.dup2(capture.fileno(), 1)
    os.dup2(capture.fileno(), 2)
    outbox.send(("ready",))
    while True:
        try:
            data = inbox.recv_bytes()
        except EOFError:  # the runner closed
            return
        sys.stdout.flush()
        sys.stderr.flush()
        capture.seek(0)
        capture.truncate()
        try:
            fn, arguments, max_chars = pickle.loads(data)
        except Exception as e:  # the tool's module does not import here
            outbox.send(("done", f"error: the tool could not be loaded ({type(e).__name__}: {e})", ""))
            continue
        outbox.send(("start",))
        try:
            text = cut(as_text(fn(**arguments)), max_chars)
        except BaseException as e:  # the model sees it
            text = cut(f"error: {type(e).__name__}: {e}", max_chars)
        sys.stdout.flush()
        sys.stderr.flush()
        capture.seek(0)
        printed = capture.read(4 * max_chars + 4).decode("utf-8", errors="replace")
        outbox.send(("done", text, cut(printed, max_chars)))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
