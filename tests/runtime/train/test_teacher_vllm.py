"""``teacher.url`` against vLLM's own OpenAI-compatible server (the CPU build).

The server runs from the vLLM venv (this interpreter when it has vLLM, else $RLDSL_VLLM_PYTHON:
`make test-vllm` runs this file in the main venv with the .venv-vllm python), on 127.0.0.1,
started and stopped here (start-up bounded at 300 s); the run itself needs no vLLM. The teacher is a random-init float32
Llama with the toy tokenizer and head dim 64 (vLLM's CPU attention refuses the embedded model's
24), served with ``--max-logprobs 8``. Without a vLLM venv the tests skip, or fail under
RLDSL_REQUIRE_VLLM=1.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from rldsl.runtime.errors import ConfigError
from rldsl.runtime.run import loop
from test_distill_teachers import TOPK4, _capture, _same_as_in_process
from small_run import small_run, steps_of

pytestmark = pytest.mark.slow

START_S = 300


def vllm_python() -> str | None:
    """This interpreter when it has vLLM, else $RLDSL_VLLM_PYTHON (`make test-vllm` sets it to
    the vLLM venv's python and runs this file in the main venv)."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    cand = os.environ.get("RLDSL_VLLM_PYTHON")  # relative to where pytest started: made absolute here,
    # since the server starts in a folder of its own
    return str(Path(cand).absolute()) if cand and Path(cand).is_file() else None


@pytest.fixture(scope="module")
def teacher_64(tmp_path_factory):
    from transformers import LlamaForCausalLM
    from rldsl.runtime.toy import build_tokenizer, tiny_config
    tok = build_tokenizer()
    config = tiny_config(tok, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)
    config.initializer_range = 0.1
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("vllm-teacher")
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vllm_server(teacher_64, tmp_path_factory):
    """`python -m vllm.entrypoints.openai.api_server` serving the teacher; yields its /v1 URL."""
    python = vllm_python()
    if python is None:
        reason = "no vLLM here: make test-vllm runs this file with RLDSL_VLLM_PYTHON=.venv-vllm/bin/python"
        if os.environ.get("RLDSL_REQUIRE_VLLM") == "1":
            pytest.fail(f"RLDSL_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tmp_path_factory.mktemp("vllm-server")
    log = open(work / "server.log", "w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(teacher_64),
                             "--served-model-name", "teacher", "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "64", "--max-logprobs", "8",
                             "--enforce-eager"], cwd=work, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the vLLM server exited ({proc.returncode}):\n"
                            + (work / "server.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(url + "/models", timeout=2) as r:
                    if json.loads(r.read())["data"]:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not answer within {START_S} s:\n"
                            + (work / "server.log").read_text()[-3000:])
            time.sleep(1)  # polling a process that starts on its own clock
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # the server and its engine process: their own session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.mark.parametrize("k", [0, 4])
def test_three_steps_with_vllm_as_the_teacher(k, vllm_server, teacher_64, model_dir, tmp_path, monkeypatch):
    """opd (k 0) and a top-4 spec, 3 steps: the teacher's logprobs and top-k that vLLM's
    prompt_logprobs give equal the in-process teacher's (float32, vLLM's CPU kernels: 1e-4)."""
    seen = _capture(monkeypatch)
    spec = "opd"
    if k:
        spec = str(tmp_path / "topk4.rl")
        (tmp_path / "topk4.rl").write_text(TOPK4)
    run = loop.train(spec, small_run(model_dir, tmp_path / "run", **{"teacher.url": vllm_server}))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["distill/divergence"] > 0 for r in recs)
    _same_as_in_process(seen, teacher_64, k, atol=1e-4)


def test_top_k_beyond_vllms_max_logprobs_is_refused_at_start(vllm_server, model_dir, tmp_path):
    (tmp_path / "topk16.rl").write_text(TOPK4.replace("k=4", "k=16"))
    with pytest.raises(ConfigError, match=r"topk4: the teacher server does not return top-16 prompt logprobs: "
                                          r".*HTTP 400.*greater than max allowed: 8"):
        loop.train(str(tmp_path / "topk16.rl"), small_run(model_dir, tmp_path / "run",
                                                              **{"teacher.url": vllm_server}))
