"""The tool runner: a bounded pool of worker processes (rollout.tool_workers), each call's limit
counted from when it starts running, a hung call killed without touching the other calls, and a
tool's printed output captured and cut instead of reaching the console."""
from __future__ import annotations

import time

import pytest

from rldsl.runtime.rollout.episodes.env import ToolEnv
from rldsl.runtime.rollout.episodes.tool_worker import TRUNCATED
from rldsl.runtime.rollout.episodes.tools import ToolPool


@pytest.fixture()
def runner():
    made: list[ToolPool] = []

    def make(workers: int) -> ToolPool:
        made.append(ToolPool(workers))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.mark.slow
def test_a_hung_call_does_not_fail_the_calls_queued_behind_it(runner) -> None:
    """One worker, the first call hangs: it alone is answered with the time-out; the calls queued
    behind it run on a fresh worker, each within its own limit, with their right results."""
    from tool_helpers import echo, hang

    r = runner(1)
    out = r.run_many([(hang, {"x": 0})] + [(echo, {"text": f"t{i}"}) for i in range(5)],
                     timeout_s=1.0, max_output_chars=100)
    assert out == ["error: the tool took longer than 1 s"] + [f"t{i}" for i in range(5)]


@pytest.mark.slow
def test_killing_a_hung_call_leaves_the_running_ones_alone(runner) -> None:
    """Two workers: while one call hangs, the other worker runs naps back to back (3 s in all),
    so one of them is running when the hung worker is killed at 2 s; every nap answers."""
    from tool_helpers import hang, nap

    r = runner(2)
    calls = [(hang, {"x": 0})] + [(nap, {"seconds": 0.5, "tag": f"n{i}"}) for i in range(6)]
    out = r.run_many(calls, timeout_s=2.0, max_output_chars=100)
    assert out == ["error: the tool took longer than 2 s"] + [f"n{i}" for i in range(6)]
    assert len(r._pool) <= 2  # the bound holds, replacements included


@pytest.mark.slow
def test_worker_start_up_is_not_counted_against_a_call(runner, tmp_path) -> None:
    """Workers that take a second to start (an interpreter behind a slow wrapper: the fault
    injected) and a limit of 0.2 s: the first calls still get their own results, not a false
    time-out."""
    import sys

    from tool_helpers import boom, echo

    slow = tmp_path / "slow-python"
    slow.write_text(f'#!/bin/sh\nsleep 1\nexec "{sys.executable}" "$@"\n')
    slow.chmod(0o755)
    r = runner(3)
    r.python = str(slow)
    t0 = time.monotonic()
    out = r.run_many([(boom, {"x": 1}), (echo, {"text": "a"}), (echo, {"text": "b"})], timeout_s=0.2,
                     max_output_chars=100)
    assert time.monotonic() - t0 > 1.0  # the start-up did take longer than the limit
    assert out == ["error: RuntimeError: boom 1", "a", "b"]


@pytest.mark.slow
def test_the_pool_runs_calls_at_once_up_to_its_bound(runner) -> None:
    """Four naps of 1 s on 4 workers end in about 1 s once the workers are up, not 4 s; the
    pool never grows past its bound."""
    from tool_helpers import echo, nap

    r = runner(4)
    assert r.run_many([(echo, {"text": str(i)}) for i in range(4)], timeout_s=30, max_output_chars=10) == \
        ["0", "1", "2", "3"]  # start the 4 workers
    t0 = time.monotonic()
    out = r.run_many([(nap, {"seconds": 1.0, "tag": str(i)}) for i in range(4)], timeout_s=30, max_output_chars=10)
    took = time.monotonic() - t0
    assert out == ["0", "1", "2", "3"] and took < 3.0 and len(r._pool) == 4
    r.resize(2)
    assert len(r._pool) == 2


@pytest.mark.slow
def test_a_tools_output_is_captured_and_cut_not_printed(runner, capfd) -> None:
    """A tool printing 5 MB: nothing reaches the run's console; the tool message keeps the first
    max_output_chars of it under "output", the result is the return value."""
    from tool_helpers import loud

    env = ToolEnv([loud], max_output_chars=200, pool=runner(1))
    result = env.step({"role": "assistant",
                       "content": '<tool_call>{"name": "loud", "arguments": {"megabytes": 5}}</tool_call>'})
    out, err = capfd.readouterr()
    assert "yyyy" not in out + err and "a warning" not in out + err
    message = result.messages[0]
    assert message["content"] == "done"
    assert message["output"] == "y" * 200 + TRUNCATED


@pytest.mark.slow
def test_a_worker_that_cannot_start_fails_its_calls_once(runner) -> None:
    """A worker process that exits before it is ready (here: an interpreter that is not one)
    answers the waiting calls with the error, instead of being restarted forever."""
    from tool_helpers import echo

    r = runner(2)
    r.python = "/bin/false"
    out = r.run_many([(echo, {"text": "a"}), (echo, {"text": "b"})], timeout_s=5, max_output_chars=100)
    assert out == ["error: the tool's process could not start (exit code 1)"] * 2


@pytest.mark.slow
def test_a_worker_starts_without_the_runtime_and_imports_tools_from_the_runs_path(runner, tmp_path,
                                                                                  monkeypatch) -> None:
    """The worker is a standard-library script: it never imports torch (it starts in well under
    a second), and it imports a tool's module from the run's sys.path -- here a relative entry,
    made absolute, since the worker works in a folder of its own."""
    (tmp_path / "mytools.py").write_text(
        "import sys\n\ndef loaded() -> str:\n    \"\"\"Which heavy modules the worker holds.\"\"\"\n"
        "    return str(sorted(m for m in ('torch', 'transformers', 'rldsl') if m in sys.modules))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(".")
    import mytools

    r = runner(1)
    t0 = time.monotonic()
    assert r.run_many([(mytools.loaded, {})], timeout_s=30, max_output_chars=100) == ["[]"]
    assert time.monotonic() - t0 < 20  # the first call, worker start-up included
