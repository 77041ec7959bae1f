"""A two-node Ray cluster started outside rldsl (`ray start`), a run that joins it with
``--ray-address``, one node lost mid-run: the steps of test_ray_nodes.py, run as a script in a
network namespace of its own (``unshare -rnu``), so that every Ray process can bind only the
loopback interface and every port it takes is free whatever else runs on the machine.

Why a namespace: Ray 2.60 turns ``127.0.0.1`` (``--node-ip-address``, ``--address``) into the
address its host reaches the internet from (``services.resolve_ip_for_localhost``). The head then
advertises that address, binds the client server to it and the GCS and raylet to every
interface, and a second ``ray start --address=127.0.0.1:PORT`` joins through it. In a network
namespace holding only ``lo`` (and a host name of ``localhost`` in a UTS namespace) that
resolution answers 127.0.0.1 itself, and Ray binds every listener there.

    python ray_nodes.py MODEL_DIR WORKDIR     (inside the namespaces)

Writes ``WORKDIR/facts.json``: what happened (listeners, where each actor ran, exit codes and
outputs); the test asserts on it and on the run folder. Every process is stopped by its pid.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil

from fault_helpers import child_env, run_args, start, wait_held

RAY_START = "from ray.scripts.scripts import main; main()"  # `ray start` of this interpreter's Ray
HEAD_PORT = 6379
#: the ports a node other than the head is given (the head takes Ray's defaults): the nodes share lo
PORT_FLAGS = ("node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent",
              "metrics-export")
ACTORS = ("ray::TrainerWorker", "ray::RolloutWorker")


def node_ports(base: int) -> list[str]:
    return [f"--{flag}-port={base + i}" for i, flag in enumerate(PORT_FLAGS, 1)]


def loopback_up() -> None:
    """``ip link set lo up`` (a new network namespace starts with lo down), without iproute2."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def listeners() -> list[dict]:
    """Every listening TCP socket of this namespace (all of them this test's): address, port and
    the processes holding it."""
    owners: dict[str, list[str]] = {}
    for p in psutil.process_iter(["pid", "name"]):
        try:
            for fd in os.scandir(f"/proc/{p.pid}/fd"):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    owners.setdefault(target[8:-1], []).append(f"{p.info['name']}({p.pid})")
        except (OSError, psutil.Error):
            pass
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A":  # LISTEN
                continue
            addr, port = cols[1].split(":")
            out.append({"address": _address(addr, v6), "port": int(port, 16), "owners": owners.get(cols[9], [])})
    return out


def _address(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # /proc prints each 32-bit word host-order
    return socket.inet_ntop(socket.AF_INET6, words)


def is_loopback(address: str) -> bool:
    return address == "127.0.0.1" or address == "::ffff:127.0.0.1"


class Node:
    """One `ray start --block` process (it stays in the foreground and owns the node's processes)."""

    def __init__(self, name: str, args: list[str], workdir: Path, env: dict[str, str]):
        self.name, self.log = name, workdir / f"{name}.log"
        with open(self.log, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", RAY_START, "start", *args, "--block",
                                          f"--temp-dir={workdir / 'ray'}", "--disable-usage-stats"],
                                         env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_started(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`ray start` ({self.name}) did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def processes(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def raylet(self) -> psutil.Process:
        found = [p for p in self.processes() if p.name() == "raylet"]
        assert len(found) == 1, (self.name, found)
        return found[0]

    def actors(self) -> list[str]:
        """The rldsl actors running on this node (the raylet starts them)."""
        names = []
        for p in self.processes():
            try:
                title = (p.cmdline() or [""])[0]
            except psutil.Error:
                continue
            names += [a for a in ACTORS if title.startswith(a)]
        return sorted(names)

    def stop(self) -> None:
        """SIGTERM the `ray start` process (it stops what it started), then SIGKILL what is left."""
        family = self.processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _gone, alive = psutil.wait_procs(family, timeout=30)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def resume(run: Path, env: dict[str, str]) -> dict:
    """`rldsl run --resume RUN` to the end: exit code, output, wall seconds, and the recovery time
    (from the command's start to its first step starting: the first new metrics record, less
    that step's own time), measured by watching metrics.jsonl grow."""
    metrics = run / "metrics.jsonl"
    before = len(metrics.read_text().splitlines())
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "rldsl.cli", "run", "--resume", str(run)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    while first is None and proc.poll() is None:  # a measurement, not a synchronisation
        lines = metrics.read_text().splitlines()
        if len(lines) > before and lines[-1].endswith("}"):
            first = time.monotonic() - t0 - json.loads(lines[before]).get("step_s", 0.0)
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=600)
    return {"exit": proc.returncode, "output": out[-6000:], "seconds": time.monotonic() - t0, "recovery_s": first}


def main(model_dir: Path, workdir: Path) -> None:
    facts: dict = {}
    nodes: list[Node] = []
    try:
        loopback_up()
        socket.sethostname("localhost")  # Ray's own address lookup falls back to the host name
        env = child_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))  # each process has it
        head = Node("head", ["--head", "--node-ip-address=127.0.0.1", f"--port={HEAD_PORT}", "--num-cpus=2",
                             "--include-dashboard=false"], workdir, env)
        nodes.append(head)
        head.wait_started()
        second = Node("node2", [f"--address=127.0.0.1:{HEAD_PORT}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                                *node_ports(7100)], workdir, env)
        nodes.append(second)
        second.wait_started()
        facts["listeners"] = listeners()

        run, held = workdir / "run", workdir / "held"
        args = run_args(model_dir, run, "train.steps=4", "checkpoint.every=1", "distributed.sync_timeout=120") + [
            "--ray-address", f"127.0.0.1:{HEAD_PORT}", "--trainers", "2", "--rollout-workers", "1"]
        proc = start(args, held, "step@2:hold", **{k: env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")})
        wait_held(proc, held)
        facts["actors"] = {n.name: n.actors() for n in nodes}
        facts["listeners_during_run"] = listeners()
        raylet = second.raylet()
        facts["killed"] = f"raylet({raylet.pid})"
        t0 = time.monotonic()
        raylet.kill()  # SIGKILL: the node is lost with every process it ran
        psutil.wait_procs([raylet], timeout=30)
        replacement = Node("node3", [f"--address=127.0.0.1:{HEAD_PORT}", "--node-ip-address=127.0.0.1",
                                     "--num-cpus=1", *node_ports(7200)], workdir, env)
        nodes.append(replacement)  # the lost node replaced, as a cluster manager would
        replacement.wait_started()
        t1 = time.monotonic()
        held.unlink()  # the run goes on
        out, _ = proc.communicate(timeout=600)
        facts["run"] = {"exit": proc.returncode, "output": out[-6000:], "replacement_s": t1 - t0,
                        "to_exit_s": time.monotonic() - t1}
        if proc.returncode != 0:  # a lost trainer rank: the run stops with the command that resumes it
            facts["resume"] = resume(run, env)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
        facts["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for node in reversed(nodes):
            node.stop()
        facts["left"] = [f"{p.name()}({p.pid})" for n in nodes for p in n.processes()]
        (workdir / "facts.json").write_text(json.dumps(facts, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
