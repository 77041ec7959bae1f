"""Helpers of the fault suite: the runs, their processes, what they left; the reward functions the
runs load by `fault_helpers:NAME` (this folder is on sys.path)."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from rldsl.runtime.records.checkpoint import latest_checkpoint, read_weights
from rldsl.runtime.records.metrics import read_metrics
from rldsl.runtime.records.run_dir import SAMPLES_FILE

HERE = Path(__file__).parent
TIMING = ("time/", "step_s", "tokens_per_s")
#: the runs of the suite: small enough that a process costs its start-up (~5 s) and little more
BASE = ["rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=4", "train.steps=6",
        "eval.every=0", "data.eval_size=4", "eval.samples=0", "checkpoint.every=1", "log.progress=false",
        "reward.name=fault_helpers:parity", "train.minibatches=2", "train.lr=0.01", "log.samples_per_step=2"]


def parity(prompt: str, completion: str, answer: str) -> float:
    """1 for completions of odd length: rewards of every model mixed, so advantages are not all 0."""
    return float(len(completion) % 2)


def run_args(model_dir: Path, out: Path, *sets: str) -> list[str]:
    args = ["run", "grpo", "--model", str(model_dir), "--out", str(out)]
    for s in (*BASE, *sets):
        args += ["--set", s]
    return args


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)  # eager, and this folder importable: tests/conftest.py
    env.update(extra)
    return env


class ForkServer:
    """The suite's `rldsl` processes, forked by tests/faults/forkserver.py (started once, on first
    use): each a process of its own, without an interpreter start's imports to pay for."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "forkserver.py")], env=child_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE)
        self.lock = threading.Lock()
        self.logs = Path(tempfile.mkdtemp(prefix="rldsl-fault-logs-"))  # each process's stdout, stderr

    def ask(self, **req: object) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server ended (exit {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()  # it kills what still runs, then exits
        self.proc.wait(timeout=60)
        shutil.rmtree(self.logs, ignore_errors=True)


_server: ForkServer | None = None


def fork_server() -> ForkServer:
    global _server
    if _server is None:
        _server = ForkServer()
        atexit.register(_server.close)
    return _server


class Forked:
    """A forked `rldsl ARGS` as the suite uses a Popen: ``pid``, ``poll()``, ``wait()``, ``kill()``,
    ``communicate()``, ``returncode``, ``stdout.read()`` (stdout and stderr are files)."""

    def __init__(self, args: list[str], env: dict[str, str], logs: Path, *, merged: bool = False) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.out = logs / "stdout"
        self.err = self.out if merged else logs / "stderr"  # merged: stderr=STDOUT
        self.args, self.returncode = args, None
        self.pid = fork_server().ask(op="spawn", args=args, env=env, cwd=os.getcwd(), out=str(self.out),
                                     err=str(self.err))["pid"]
        self.stdout = self  # ``proc.stdout.read()``: what it printed on both

    def poll(self) -> int | None:
        return self.wait(0)

    def wait(self, timeout: float = 300) -> int | None:
        if self.returncode is None:
            self.returncode = fork_server().ask(op="wait", pid=self.pid, timeout=timeout)["code"]
            if self.returncode is None and timeout > 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def read(self) -> str:
        out, err = self._texts()
        return out + (err or "")

    def communicate(self, timeout: float = 300) -> tuple[str, str | None]:
        self.wait(timeout)
        return self._texts()

    def _texts(self) -> tuple[str, str | None]:
        out = self.out.read_text(errors="replace")
        return out, None if self.err == self.out else self.err.read_text(errors="replace")


def log_dir() -> Path:
    return Path(tempfile.mkdtemp(dir=fork_server().logs))


def rldsl(args: list[str], *, fault: str | None = None, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """`rldsl ARGS` to the end, with ``RLDSL_FAULT=fault``; stdout/stderr captured."""
    e = child_env(**env)
    if fault:
        e["RLDSL_FAULT"] = fault
    proc = Forked(args, e, log_dir())
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def start(args: list[str], held: Path, fault: str, **env: str) -> Forked:
    """`rldsl ARGS` in a process group of its own, to be held at ``fault`` (``...:hold``); its stderr
    in its stdout."""
    return Forked(args, child_env(RLDSL_FAULT=fault, RLDSL_FAULT_HELD=str(held), **env), log_dir(),
                  merged=True)


def wait_held(proc: subprocess.Popen, held: Path, timeout: float = 300) -> None:
    """Until the run reaches its hold (the file appears); fails if it ends first."""
    deadline = time.monotonic() + timeout
    while not held.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before its hold:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("the run did not reach its hold")
        time.sleep(0.05)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's whole process group (the driver and whatever it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def steps_of(run: Path) -> list[dict]:
    """The training steps' records, timings left out."""
    return [{k: v for k, v in r.items() if not _timed(k)}
            for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]


def _timed(key: str) -> bool:
    """A metric that measures time (rates and the model-flops utilisation included)."""
    return key.startswith(TIMING) or key.endswith("_per_s") or key == "perf/mfu"


def step_numbers(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run / "metrics.jsonl")]


def samples_of(run: Path) -> list[dict]:
    path = run / SAMPLES_FILE
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return read_weights(latest_checkpoint(run) / "policy")


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlowFirstServer:
    """A reward server (the protocol of runtime/rewards/remote.py) on 127.0.0.1 whose first answer
    comes ``delay`` s late — past the client's time-out — and every later one at once:
    ``with SlowFirstServer(3.0) as url:``; ``bodies``: the requests it got, in order."""

    def __init__(self, delay: float) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.delay, self.bodies, self.lock = delay, [], threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.bodies.append(body)
                    first = len(outer.bodies) == 1
                if first:
                    time.sleep(outer.delay)  # the client has given up on this one by then
                answer = json.dumps({"rewards": [parity("", c, "") for c in body["completions"]]}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except OSError:  # the client hung up after its time-out
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/score"

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
