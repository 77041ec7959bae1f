"""The per-prompt reward statistics across steps (records/prompt_stats.py): Welford's running
count / mean / variance against two-pass references computed by hand, failed rewards left out,
the saved state restored bit for bit, and the state kept only for a spec that reads it."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import rldsl
from rldsl.runtime.records.prompt_stats import PromptStats, prompt_key
from rldsl.runtime.train.inputs import reads_history

ROOT = Path(__file__).resolve().parents[3]
NAN = float("nan")


def _two_pass(xs: list[float]) -> tuple[float, float, float]:
    """mean, population variance, count of the finite values: the textbook two-pass formulas."""
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return 0.0, 0.0, 0.0
    m = sum(xs) / len(xs)
    return m, sum((x - m) ** 2 for x in xs) / len(xs), float(len(xs))


def test_running_statistics_over_steps_equal_the_two_pass_ones() -> None:
    """Two prompts over three steps (G = 2); prompt b is absent from step 2, a reward of a fails
    in step 3. Each step's reading includes its own rewards."""
    a, b, c = prompt_key("1+2="), prompt_key("3+4="), prompt_key("5+6=")
    stats = PromptStats()
    steps = [([a, b], [1.0, 0.0, 0.5, 0.5]), ([a, c], [1.0, 1.0, 0.2, 0.9]), ([b, a], [0.0, 1.0, NAN, 0.0])]
    seen: dict[int, list[float]] = {}
    for keys, rewards in steps:
        stats.update(keys, torch.tensor(rewards, dtype=torch.float64))
        got = stats.read(keys, 2)
        for p, k in enumerate(keys):
            seen.setdefault(k, []).extend(rewards[2 * p:2 * p + 2])
            mean, var, count = _two_pass(seen[k])
            for row in (2 * p, 2 * p + 1):  # the prompt's value on each of its G rows
                assert float(got["prompt_mean"][row]) == pytest.approx(mean, abs=1e-7)
                assert float(got["prompt_var"][row]) == pytest.approx(var, abs=1e-7)
                assert float(got["prompt_count"][row]) == count
    # by hand: a's rewards 1, 0, 1, 1, 0 (the NaN left out) -> mean 0.6, var 0.24, count 5; its
    # groups (1, 0), (1, 1), (0): Bessel variances 0.5, 0, 0 (one reward) -> 3 steps, mean 1/6
    last = stats.read([a], 1)
    assert [float(last[k][0]) for k in ("prompt_mean", "prompt_var", "prompt_count")] == \
        pytest.approx([0.6, 0.24, 5.0], abs=1e-7)
    assert [float(last[k][0]) for k in ("prompt_steps", "prompt_step_var")] == pytest.approx([3.0, 1 / 6], abs=1e-7)
    assert all(v.dtype == torch.float32 and v.shape == (1,) for v in last.values())


def test_steps_and_the_mean_step_variance_equal_the_two_pass_ones() -> None:
    """prompt_steps counts the groups of the prompt with a finite reward, prompt_step_var is the
    mean of their Bessel variances (torch.var's), each step's reading including its own group;
    with G rewards a step, prompt_var + prompt_step_var / G is the mean of the steps' Bessel
    variances plus the variance of their means (what DCPO's smooth standardisation divides by)."""
    g = torch.Generator().manual_seed(1)
    keys = [prompt_key(f"{i}*2=") for i in range(3)]
    stats, groups = PromptStats(), {k: [] for k in keys}
    for step in range(4):
        order = keys[step % 3:] + keys[:step % 3]
        picked = order[:2]  # two of the three prompts a step: each comes back
        rewards = torch.rand(2 * 5, generator=g, dtype=torch.float64)
        stats.update(picked, rewards)
        got = stats.read(picked, 5)
        for p, k in enumerate(picked):
            groups[k].append(rewards[5 * p:5 * p + 5])
            steps = torch.stack(groups[k])
            step_var = float(steps.var(dim=1).mean())  # Bessel's, per step
            assert float(got["prompt_steps"][5 * p]) == len(groups[k])
            assert float(got["prompt_step_var"][5 * p]) == pytest.approx(step_var, abs=1e-7)
            between = float(steps.mean(dim=1).var(unbiased=False))
            smooth = float(got["prompt_var"][5 * p]) + float(got["prompt_step_var"][5 * p]) / 5
            assert smooth == pytest.approx(step_var + between, abs=1e-6)


def test_a_checkpoint_from_before_the_step_columns_loads() -> None:
    """A state saved with three columns (count, mean, M2) reads 0 steps, the rest unchanged."""
    stats = PromptStats()
    stats.load_state_dict({"keys": torch.tensor([7], dtype=torch.int64),
                           "stats": torch.tensor([[2.0, 0.5, 0.5]], dtype=torch.float64)})
    assert stats.state_dict()["stats"].tolist() == [[2.0, 0.5, 0.5, 0.0, 0.0]]
    assert float(stats.read([7], 1)["prompt_var"][0]) == 0.25


def test_a_prompt_without_a_finite_reward_reads_zeros() -> None:
    stats = PromptStats()
    k = prompt_key("never scored")
    stats.update([k], torch.tensor([NAN, NAN]))
    got = stats.read([k, prompt_key("never seen")], 2)
    assert all(v.tolist() == [0.0] * 4 for v in got.values())


def test_the_saved_state_is_restored_bit_for_bit() -> None:
    """float64 sums of awkward values: what a resumed run folds the next step into is exactly the
    uninterrupted run's state (no float32 round trip)."""
    g = torch.Generator().manual_seed(0)
    stats = PromptStats()
    keys = [prompt_key(f"{i}+{i}=") for i in range(5)]
    for _ in range(3):
        stats.update(keys, torch.rand(5 * 3, generator=g, dtype=torch.float64) / 3)
    saved = stats.state_dict()
    assert saved["keys"].dtype == torch.int64 and saved["stats"].dtype == torch.float64
    again = PromptStats()
    again.load_state_dict({k: v.clone() for k, v in saved.items()})
    nxt = torch.rand(15, generator=g, dtype=torch.float64)
    stats.update(keys, nxt)
    again.update(keys, nxt)
    assert torch.equal(stats.state_dict()["stats"], again.state_dict()["stats"])
    assert torch.equal(stats.state_dict()["keys"], again.state_dict()["keys"])


def test_prompt_keys_are_stable_and_tell_prompts_apart() -> None:
    """A prompt's key is the same in every process (not Python's salted hash) and fits int64."""
    assert prompt_key("1+2=") == prompt_key("1+2=") != prompt_key("1+3=")
    msgs = ({"role": "user", "content": "hi"},)
    assert prompt_key(msgs) == prompt_key(({"role": "user", "content": "hi"},)) != prompt_key("hi")
    assert 0 <= prompt_key("1+2=") < 2 ** 63
    import hashlib  # the definition, spelled out once: the first 8 bytes of SHA-256, little-endian, >> 1
    assert prompt_key("1+2=") == int.from_bytes(hashlib.sha256(b"'1+2='").digest()[:8], "little") >> 1


def test_a_spec_keeps_state_only_when_it_reads_the_statistics() -> None:
    smoothed = rldsl.load(str(ROOT / "tests" / "specs" / "formula" / "smoothed_std.rl"))
    assert reads_history(smoothed) and "prompt_var" in smoothed.needs("advantage")
    dcpo = rldsl.load(str(ROOT / "algorithms" / "examples" / "dcpo_sas.rl"))
    assert reads_history(dcpo) and {"prompt_steps", "prompt_step_var"} <= set(dcpo.needs("advantage"))
    for name in ("grpo", "rloo", "ppo", "gdpo", "remax"):
        assert not reads_history(rldsl.load(name)), name


def test_misgrouped_rewards_are_refused() -> None:
    with pytest.raises(ValueError, match="not a whole number of groups"):
        PromptStats().update([1, 2], torch.zeros(3))
