"""The per-prompt statistics across steps in advantage-stage formulas: `prompt_mean`, `prompt_var`,
`prompt_count` ([B], each prompt's value on its G rows), against hand-computed references; absent
or misshapen ones fail by name, as every input does."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rldsl
from rldsl import SpecError

ROOT = Path(__file__).resolve().parents[2]
MASK = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
R = torch.tensor([1.0, 0.0, 1.0, 1.0])
# prompt 0 (rows 0, 1): rewards so far 1, 0 (this step) and 1, 1 (an earlier one): mean 0.75, var 0.1875
# prompt 1 (rows 2, 3): only this step's 1, 1: mean 1, var 0
MEAN = torch.tensor([0.75, 0.75, 1.0, 1.0])
VAR = torch.tensor([0.1875, 0.1875, 0.0, 0.0])
COUNT = torch.tensor([4.0, 4.0, 2.0, 2.0])
STATS = dict(prompt_mean=MEAN, prompt_var=VAR, prompt_count=COUNT)


def _spec(slot: str, body: str, rest: str = "  baseline  none\n  normalizer  none\n") -> rldsl.Algorithm:
    text = f"algorithm st extends grpo\n  define st_{slot}\n{body}  end\n  {slot}  st_{slot}\n"
    lines = [ln for ln in rest.splitlines(keepends=True) if not ln.split()[0] == slot]
    return rldsl.loads(text + "".join(lines))


def test_the_example_divides_by_the_running_std() -> None:
    """smoothed_std: A = (r - group_mean(r)) / (sqrt(prompt_var) + 1e-6)."""
    fn = rldsl.compile(rldsl.load(str(ROOT / "tests" / "specs" / "formula" / "smoothed_std.rl")))
    adv = fn.estimate(R, 2, MASK, **STATS).advantages
    sd = 0.1875 ** 0.5
    want = torch.tensor([0.5 / (sd + 1e-6), -0.5 / (sd + 1e-6), 0.0, 0.0])
    torch.testing.assert_close(adv[:, 0], want, rtol=1e-6, atol=1e-7)
    assert torch.all(adv[MASK == 0] == 0)


def test_a_baseline_reads_the_running_mean_and_a_filter_the_count() -> None:
    fn = rldsl.compile(_spec("baseline", "    b = prompt_mean\n"))
    adv = fn.estimate(R, 2, MASK, **STATS).advantages
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.25, -0.75, 0.0, 0.0]), rtol=1e-6, atol=1e-7)
    keep = rldsl.compile(_spec("filter", "    keep = prompt_count >= 3\n"))
    est = keep.estimate(R, 2, MASK, **STATS)
    assert (est.mask.sum(-1) > 0).tolist() == [True, True, False, False]


def test_a_normalizer_reads_the_running_variance() -> None:
    """A' = A / sqrt(prompt_var + 1/prompt_count): GRPO's group-centred A, smoothed."""
    fn = rldsl.compile(_spec("normalizer", "    A = A / sqrt(prompt_var + 1 / prompt_count)\n",
                             rest="  baseline  group_mean\n"))
    adv = fn.estimate(R, 2, MASK, **STATS).advantages
    want = torch.tensor([0.5 / (0.1875 + 0.25) ** 0.5, -0.5 / (0.1875 + 0.25) ** 0.5, 0.0, 0.0])
    torch.testing.assert_close(adv[:, 0], want, rtol=1e-6, atol=1e-7)


def test_absent_or_misshapen_statistics_fail_by_name() -> None:
    algo = _spec("baseline", "    b = prompt_mean\n")
    assert algo.needs("advantage") == ["prompt_mean"]
    fn = rldsl.compile(algo)
    with pytest.raises(ValueError, match="needs prompt_mean="):
        fn.estimate(R, 2, MASK)
    with pytest.raises(ValueError, match=r"prompt_mean must be \[B\]"):
        fn.estimate(R, 2, MASK, prompt_mean=MEAN[:3])
    with pytest.raises(ValueError, match="prompt_mean"):
        fn.estimate(R, 2, MASK, prompt_mean=torch.tensor([0.0, float("nan"), 0.0, 0.0]))


def test_the_statistics_are_advantage_stage_only() -> None:
    """The loss does not receive them: a loss formula reading one is a spec error naming it."""
    with pytest.raises(SpecError, match="prompt_mean"):
        rldsl.loads("algorithm st extends grpo\n  define o\n    l = -A * rho * prompt_mean\n  end\n"
                    "  objective  o\n")
