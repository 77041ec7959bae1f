"""Reward functions for the runtime tests, loaded by `module:function` (this folder is put on sys.path)."""
from __future__ import annotations

import os
import time


_CALLS = [0]


def parity(prompt: str, completion: str, answer: str) -> float:
    """1 for completions of odd length: a mix of rewards from any model, so advantages are not all 0.

    A run whose environment sets RLDSL_TEST_HOLD_REWARD_AFTER=N hangs in its (N+1)-th call, so
    a test can kill it at a known point (after N samples were scored) without racing it."""
    _CALLS[0] += 1
    hold = os.environ.get("RLDSL_TEST_HOLD_REWARD_AFTER")
    if hold is not None and _CALLS[0] > int(hold):
        time.sleep(3600)
    return float(len(completion) % 2)


def answer_prefix(prompt: str, completion: str, answer: str) -> float:
    """Partial credit: the fraction of the answer's leading characters that the completion matches."""
    n = 0
    for a, c in zip(answer, completion):
        if a != c:
            break
        n += 1
    return n / max(len(answer), 1)


def explode(prompt: str, completion: str, answer: str) -> float:
    """Fails on completions starting with '1' (tests the reward-error path)."""
    if completion.startswith("1"):
        raise ZeroDivisionError("boom")
    return 0.5


def quarter(prompt: str, completion: str, answer: str) -> float:
    """0.25 for everything: a reward whose mean is known whatever the model writes."""
    return 0.25


def fifth(prompt: str, completion: str, answer: str) -> float:
    """0.2 for everything: reasoning-gym's partial credit, a value float32 cannot hold."""
    return 0.2


def slow_parity(prompt: str, completion: str, answer: str) -> float:
    """``parity`` after 20 ms: a reward slow enough that scoring takes longer than generating."""
    time.sleep(0.02)
    return float(len(completion) % 2)


def hangs_once(prompt: str, completion: str, answer: str) -> float:
    """``parity``, except that the first call of a run whose environment names a marker file
    (RLDSL_TEST_HANG_ONCE) that does not exist yet makes it and hangs: a call past
    reward.timeout_s at a known point, whichever process the reward runs in."""
    marker = os.environ.get("RLDSL_TEST_HANG_ONCE")
    if marker is not None and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(3600)
    return float(len(completion) % 2)


def answered(prompt: str, completion: str, answer: str) -> float:
    """1 for a final answer (text that is not a tool call), 0 for a tool call or nothing."""
    text = completion.strip()
    return float(bool(text) and "<tool_call>" not in text and not text.startswith("{"))


def assert_reference_records(run, reference, steps) -> list[dict]:
    """The records of a run reading ``ref_reward`` with ``parity`` and 2 reference answers a
    prompt, 2 steps of 16 rows: each step's ``rewards/ref/parity/mean`` is the reference batch's
    mean (every prompt has 2 answers: the mean of means), the policy's per-term metric and
    ``time/reference_s`` are logged; each samples.jsonl row holds its prompt's mean reference reward
    as ``ref_reward`` and both rewards per term. ``reference``: each step's reference call
    (engine, prompts, params, Generation); ``steps``: the run's step records. Returns the rows."""
    import json

    import pytest

    for rec, r in zip(steps, reference):
        assert rec["rewards/ref/parity/mean"] == pytest.approx(float(r[3].scored.rewards.double().mean()), abs=1e-12)
        assert "rewards/parity/mean" in rec and rec["time/reference_s"] >= 0
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 16
    for row in rows:
        step_ref = reference[row["step"] - 1][3].scored.rewards.view(-1, 2)  # [P, 2]
        assert row["ref_reward"] == pytest.approx(float(step_ref[row["group"]].mean()), abs=1e-7)
        assert set(row["rewards"]) == {"parity", "ref/parity"} and row["reward"] == row["rewards"]["parity"]
        assert row["rewards"]["ref/parity"] == pytest.approx(row["ref_reward"], abs=1e-7)
    return rows
