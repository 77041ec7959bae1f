"""reward.timeout_s: every per-sample reward call under a wall-clock limit, in the run's threads
and processes alike (rewards/deadline.py: a worker process, killed past the limit). A call past
it is its sample's error, skipped whatever reward.on_error says and counted (reward_timeouts);
the other samples are scored and the step goes on."""
from __future__ import annotations

import json
import math
import textwrap
import threading
import urllib.request

import pytest
import torch

from rldsl.runtime.batch import RolloutBatch
from rldsl.runtime.errors import RewardError, RewardTimeout
from rldsl.runtime.rewards.functions import RewardFn
from rldsl.runtime.rewards.server import BackgroundServer, make_app


def make_batch(completions: list[str], answers: list[str] | None = None) -> RolloutBatch:
    B = len(completions)
    empty = torch.zeros(B, 1, dtype=torch.long)
    return RolloutBatch(prompt_ids=empty, prompt_mask=empty, response_ids=empty, response_mask=empty,
                        logprobs=torch.zeros(B, 1), finish_reason=["stop"] * B, prompts=["p"] * B,
                        completions=list(completions), group_size=1, answers=answers or [""] * B)


@pytest.fixture
def slow_module(tmp_path, monkeypatch):
    (tmp_path / "slow_rewards.py").write_text(textwrap.dedent("""
        import sys
        import time

        def nap(prompt, completion, answer):
            if completion == "hang":
                time.sleep(3600)
            return float(len(completion))

        def boom(prompt, completion, answer):
            raise KeyError("nope")

        def bye(prompt, completion, answer):
            sys.exit(4)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)


def _in_a_thread(fn, *args):
    """``fn(*args)`` called from a thread that is not the main one (the run's reward threads, a
    Ray worker's, serve-reward's), where SIGALRM cannot limit it."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn(*args)))
    thread.start()
    thread.join()
    return out["value"]


def test_a_call_past_the_limit_is_its_samples_error_and_the_others_are_scored(slow_module) -> None:
    fn = RewardFn("slow_rewards:nap", timeout_s=1.0, workers=2)  # on_error="raise": a timeout still skips
    result = _in_a_thread(fn.score, make_batch(["ab", "hang", "abc", "hang", "x"]))
    assert result.rewards[[0, 2, 4]].tolist() == [2.0, 3.0, 1.0]
    assert math.isnan(result.rewards[1]) and math.isnan(result.rewards[3])
    assert result.num_errors == 2 and result.num_timeouts == 2
    assert "failed on sample 1: RewardTimeout: the reward took longer than 1 s (reward.timeout_s)" in result.first_error
    again = fn.score(make_batch(["abcd", "a"]))  # a fresh process took the killed one's place
    assert again.rewards.tolist() == [4.0, 1.0] and again.num_timeouts == 0


def test_errors_in_the_worker_process_are_the_functions_own(slow_module) -> None:
    with pytest.raises(RewardError, match="failed on sample 0: KeyError: 'nope'") as err:
        RewardFn("slow_rewards:boom", timeout_s=5.0).score(make_batch(["a"]))
    assert isinstance(err.value.__cause__, KeyError)
    with pytest.raises(RewardError, match=r"RuntimeError: the function called sys.exit\(4\)"):
        RewardFn("slow_rewards:bye", timeout_s=5.0).score(make_batch(["a"]))
    skipped = RewardFn("slow_rewards:boom", timeout_s=5.0, on_error="skip").score(make_batch(["a", "b"]))
    assert skipped.num_errors == 2 and skipped.num_timeouts == 0


def test_the_math_verifier_is_limited_outside_the_main_thread() -> None:
    """Nested \\frac{ costs math_verify seconds per KB; its own limit (SIGALRM) works only in a
    main thread, so from a reward thread it ran unbounded (~5 s for this 1.5 KB answer)."""
    depth = 200
    nested = "\\boxed{" + "\\frac{" * depth + "1" + "}{2}" * depth + "}"
    fn = RewardFn("math", timeout_s=1.0)
    result = _in_a_thread(fn.score, make_batch(["\\boxed{\\frac{1}{2}}", nested], ["1/2", "1/2"]))
    assert result.rewards[0].item() == 1.0 and math.isnan(result.rewards[1]) and result.num_timeouts == 1


def test_no_limit_calls_in_this_process_and_linear_builtins_never_leave_it(slow_module) -> None:
    assert RewardFn("slow_rewards:nap").timeout_s == 0.0
    fn = RewardFn("exact,addition", timeout_s=1.0)
    assert fn.score(make_batch(["1", "2"], ["1", "1"])).rewards.tolist() == [2.0, 0.0]
    assert fn._deadline is None  # string comparisons: nothing to stop, no process started
    gym = RewardFn("reasoning_gym(answer_format=plain)", timeout_s=1.0, on_error="skip")
    assert gym.score(make_batch(["1"])).num_errors == 1  # no generated row: its error, from this process
    assert gym._deadline is None  # it scores against the rows the run generated, held in this process
    with pytest.raises(ValueError, match="timeout_s"):
        RewardFn("exact", timeout_s=float("inf"))
    assert isinstance(RewardTimeout("x"), TimeoutError)


def test_serve_reward_answers_null_for_a_call_past_the_limit_and_keeps_serving(slow_module) -> None:
    with BackgroundServer(make_app("slow_rewards:nap", timeout_s=1.0)) as url:
        def post(completions: list[str]) -> dict:
            request = urllib.request.Request(url + "/score", json.dumps({"completions": completions}).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as reply:
                return json.loads(reply.read())

        answer = post(["ab", "hang", "abc"])
        assert answer["rewards"] == [2.0, None, 3.0]
        assert "RewardTimeout: the reward took longer than 1 s" in answer["errors"][1]
        assert post(["abcd"])["rewards"] == [4.0]


def test_a_worker_process_ends_when_the_run_is_killed(tmp_path) -> None:
    """A run SIGKILLed while its reward hangs leaves no worker process behind (it would hang on
    for the call's length: nothing reads the closed pipe until the call returns)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "hangs.py").write_text("import os, time\n\ndef nap(prompt, completion, answer):\n"
                                       "    open(f'started-{os.getpid()}', 'w').close()\n    time.sleep(3600)\n")
    script = ("import sys, torch\nfrom rldsl.runtime.batch import RolloutBatch\nfrom rldsl.runtime.rewards.functions "
              "import RewardFn\ne = torch.zeros(1, 1, dtype=torch.long)\nfn = RewardFn('hangs:nap', timeout_s=3600)\n"
              "fn.score(RolloutBatch(prompt_ids=e, prompt_mask=e, response_ids=e, response_mask=e, "
              "logprobs=torch.zeros(1, 1), finish_reason=['stop'], prompts=['p'], completions=['c'], group_size=1, "
              "answers=['']))\n")
    run = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    try:
        worker = None
        for _ in range(1200):  # the call runs once its marker is there (at most 120 s on a loaded machine)
            found = list(tmp_path.glob("started-*"))
            if found:
                worker = int(found[0].name.split("-")[1])
                break
            time.sleep(0.1)
        assert worker is not None, "the reward call never started"
        run.send_signal(signal.SIGKILL)
        run.wait()
        for _ in range(100):  # it looks for its parent once a second
            try:
                with open(f"/proc/{worker}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] == "Z":  # ended, not reaped yet
                        break
            except FileNotFoundError:
                break
            time.sleep(0.1)
        else:
            os.kill(worker, signal.SIGKILL)
            raise AssertionError("the worker outlived the run by 10 s")
    finally:
        if run.poll() is None:
            run.kill()


def test_a_worker_ignores_the_signals_the_run_handles(tmp_path, monkeypatch) -> None:
    """Ctrl-C and SIGTERM reach a whole process group, and the run finishes its step on them: its
    reward worker ignores both, so the call in hand is still answered."""
    import os
    import signal
    import time

    (tmp_path / "marked.py").write_text("import os, time\n\ndef slow(prompt, completion, answer):\n"
                                        "    open(f'started-{os.getpid()}', 'w').close()\n    time.sleep(2)\n"
                                        "    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    sent = []

    def signal_the_worker() -> None:
        for _ in range(1200):  # once the call runs (at most 120 s on a loaded machine)
            found = list(tmp_path.glob("started-*"))
            if found:
                worker = int(found[0].name.split("-")[1])
                for stop in (signal.SIGINT, signal.SIGTERM):
                    os.kill(worker, stop)
                    sent.append(stop)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=signal_the_worker)
    thread.start()
    result = RewardFn("marked:slow", timeout_s=60.0).score(make_batch(["a"]))
    thread.join()
    assert sent == [signal.SIGINT, signal.SIGTERM] and result.rewards.tolist() == [1.0] and result.num_errors == 0


def test_a_limit_of_years_waits_in_bounded_slices(slow_module) -> None:
    """poll(2) takes at most 2^31 - 1 ms: a limit past ~25 days was an OverflowError in the wait."""
    fn = RewardFn("slow_rewards:nap", timeout_s=1e9)
    assert fn.score(make_batch(["abc"])).rewards.tolist() == [3.0]
