"""``rldsl serve-tinker`` as a command: bad options exit 2 before any model loads, the port opens
within seconds, an idle connection stays open past uvicorn's default keep-alive (5 s), SIGTERM
stops it cleanly (exit 0)."""
from __future__ import annotations

import http.client
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tinker_helpers import NAME

RLDSL = [sys.executable, "-m", "rldsl.cli"]


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*RLDSL, "serve-tinker", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("args,message", [
    (["--model", "Qwen/Qwen3-8B-Base"], "expected NAME=PATH"),
    (["--model", "x=/no/such/folder"], "is not a Hugging Face model folder (no config.json)"),
    (["--model", "x=.", "--host", "0.0.0.0"], None),
])
def test_bad_options_exit_2_without_a_traceback(args, message, tinker_home):
    if message is None:  # a non-loopback host without a key
        args = ["--model", f"{NAME}={tinker_home / NAME}", "--host", "0.0.0.0"]
        message = "--host 0.0.0.0 is not loopback: give --api-key"
    done = _run(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_engine_vllm_without_vllm_exits_2_before_any_model_loads(tmp_path):
    """Without a --model the embedded toy would be warm-started (minutes, when not cached): the
    refusal comes first, with the install hint, and writes nothing."""
    start = time.monotonic()
    done = _run("--engine", "vllm", "--out", str(tmp_path / "states"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "--engine vllm needs vLLM, which is not installed here" in done.stderr
    assert "make setup-vllm" in done.stderr and "--engine hf" in done.stderr and "Traceback" not in done.stderr
    assert "warm start" not in done.stdout + done.stderr and not list(tmp_path.iterdir())
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("args,message", [
    (["--engine", "sglang"], "--engine 'sglang': expected one of hf, vllm"),
    (["--engine", "hf", "--vllm-memory", "1.5"], "--vllm-memory 1.5: expected a fraction in (0, 1]"),
])
def test_bad_engine_options_exit_2(args, message):
    done = _run(*args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_port_opens_keeps_idle_connections_and_sigterm_stops_it(tinker_home, tmp_path):
    port = _free_port()
    proc = subprocess.Popen([*RLDSL, "serve-tinker", "--model", f"{NAME}={tinker_home / NAME}", "--port", str(port),
                             "--out", str(tmp_path / "states")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/v1/get_server_capabilities", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the port did not open"
                time.sleep(0.2)
        assert r.json()["supported_models"][0]["model_name"] == NAME
        # a recipe's step idles its ~200 sampling connections for the length of a step: they
        # must still be open at the next (uvicorn's default closed them after 5 s)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/api/v1/healthz")
            assert conn.getresponse().read() == b'{"status":"ok"}'
            sock = conn.sock
            time.sleep(5.5)  # idle, beyond uvicorn's default keep-alive
            conn.request("GET", "/api/v1/healthz")  # on the same socket, not a new one
            assert conn.sock is sock and conn.getresponse().read() == b'{"status":"ok"}'
        finally:
            conn.close()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert f"serving the Tinker API at http://127.0.0.1:{port}" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
