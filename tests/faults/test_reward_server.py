"""A reward server that dies and comes back mid-run, and one that answers past its time-out: the
requests are retried with back-off and no sample is scored 0 (or skipped) because of it."""
from __future__ import annotations

import socket
import time
import urllib.request

from rldsl.runtime.run import loop
from rldsl.runtime.config import load_config
from rldsl.runtime.records.metrics import read_metrics

from fault_helpers import (BASE, Forked, SlowFirstServer, child_env, free_port, log_dir, parity, run_args,
                           samples_of, start, step_numbers, wait_held)


def serve(port: int) -> Forked:
    """`rldsl serve-reward fault_helpers:parity --port PORT`, once it answers GET /health."""
    proc = Forked(["serve-reward", "fault_helpers:parity", "--port", str(port)], child_env(), log_dir())
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            assert proc.poll() is None, "rldsl serve-reward exited"
            assert time.monotonic() < deadline, "rldsl serve-reward did not come up"
            time.sleep(0.1)


def without_term_labels(samples: list[dict]) -> list[dict]:
    """Sample records with each per-term value kept but not its label: the server's term is labelled
    ``server_HOST``, the reference run's local function by its name."""
    return [{**s, "rewards": sorted(s.get("rewards", {}).values())} for s in samples]


def test_a_reward_server_killed_and_restarted_mid_run_loses_no_sample(model_dir, reference, tmp_path):
    port = free_port()
    server = serve(port)
    run, held = tmp_path / "run", tmp_path / "held"
    proc = start(run_args(model_dir, run, f"reward.name=http://127.0.0.1:{port}/score(retries=8, backoff=0.5)"),
                 held, "step@2:hold")
    try:
        wait_held(proc, held)
        server.kill()
        server.wait()
        with socket.socket() as gate:  # the port, taken over to see the run's next try
            gate.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            gate.bind(("127.0.0.1", port))
            gate.listen()
            gate.settimeout(120)
            held.unlink()  # step 3 starts: its scoring finds no server
            conn, _ = gate.accept()
            conn.close()  # a try that failed: the run backs off and tries again
        server = serve(port)  # back, on the same port
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    finally:
        proc.kill()
        server.kill()
    ref = reference()
    assert step_numbers(run) == step_numbers(ref)
    recs = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert all(r["reward_errors"] == 0 for r in recs)
    refs = [r for r in read_metrics(ref / "metrics.jsonl") if "reward_mean" in r]
    assert [r["reward_mean"] for r in recs] == [r["reward_mean"] for r in refs]
    # every sample its own reward, none 0 for the outage (the per-term labels name each side's own term)
    assert without_term_labels(samples_of(run)) == without_term_labels(samples_of(ref))


def test_a_reward_server_slower_than_its_time_out_is_asked_again(model_dir, reference, tmp_path):
    slow = SlowFirstServer(delay=4.0)
    with slow as url:
        server_run = loop.train("grpo", load_config(None, [
            f"model.path={model_dir}", f"out={tmp_path / 'run'}", *BASE, "train.steps=2",
            f"reward.name={url}(timeout=1, retries=3, backoff=0.1)"]))
    assert slow.bodies[1] == slow.bodies[0]  # the request that timed out, sent again
    recs = [r for r in read_metrics(server_run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2] and all(r["reward_errors"] == 0 for r in recs)
    samples = samples_of(server_run)
    assert samples and all(s["reward"] == parity("", s["completion"], "") for s in samples)
    assert without_term_labels(samples) == without_term_labels(samples_of(reference("train.steps=2")))
