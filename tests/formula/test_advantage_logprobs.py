"""The sampled / old log-probabilities in advantage-stage formulas (shaping, baseline,
normalizer, filter): per token `old_logp`, `rollout_logp`; per sequence `old_seq_logp`,
`rollout_seq_logp`. Each against a hand-computed reference; absent or misshapen inputs fail
by name, as every input does."""
from __future__ import annotations

import pytest
import torch

import rldsl
from rldsl import SpecError
from rldsl.formula import lang

MASK = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
OLD = torch.tensor([[-0.5, -1.0, -9.0], [-0.2, -0.3, -0.1], [-2.0, 5.0, 5.0], [-0.1, -0.1, -0.4]])
ROLLOUT = OLD - torch.tensor([[0.1, 0.0, 7.0], [0.0, 0.2, 0.1], [0.6, 1.0, 1.0], [0.0, 0.0, 0.0]])
R = torch.tensor([1.0, 0.0, 1.0, 0.0])


def _spec(slot: str, body: str, rest: str = "  baseline  none\n  normalizer  none\n") -> rldsl.Algorithm:
    text = f"algorithm lik extends grpo\n  define lik_{slot}\n{body}  end\n  {slot}  lik_{slot}\n"
    lines = [ln for ln in rest.splitlines(keepends=True) if not ln.split()[0] == slot]
    return rldsl.loads(text + "".join(lines))


def _seq(x: torch.Tensor) -> list[float]:
    """sum_t mask x, by hand (padding left out, even where it holds large values)."""
    return [sum(float(x[i, t]) for t in range(3) if MASK[i, t] > 0) for i in range(4)]


def test_shaping_reads_the_old_sequence_logprob() -> None:
    """A perplexity bonus: r' = r + 0.1 * log pi_old(o) / |o|; baseline and normalizer off, so A = r'."""
    fn = rldsl.compile(_spec("shaping", "    r = r + 0.1 * old_seq_logp / L\n"))
    adv = fn.estimate(R, 2, MASK, old_logprobs=OLD).advantages
    lengths = [2, 3, 1, 3]
    want = torch.tensor([float(R[i]) + 0.1 * s / n for i, (s, n) in enumerate(zip(_seq(OLD), lengths))])
    torch.testing.assert_close(adv[:, 0], want, rtol=1e-6, atol=1e-7)
    assert torch.all(adv[MASK == 0] == 0)


def test_a_baseline_reads_per_token_old_and_rollout_logprobs() -> None:
    """b_i = mean_t (rollout_logp - old_logp) over the response; A = r - b."""
    fn = rldsl.compile(_spec("baseline", "    b = seq_mean(rollout_logp - old_logp)\n"))
    adv = fn.estimate(R, 2, MASK, old_logprobs=OLD, rollout_logprobs=ROLLOUT).advantages
    diff = _seq(ROLLOUT - OLD)
    want = torch.tensor([float(R[i]) - diff[i] / float(MASK[i].sum()) for i in range(4)])
    torch.testing.assert_close(adv[:, 0], want, rtol=1e-6, atol=1e-7)


def test_a_normalizer_reads_the_rollout_sequence_logprob() -> None:
    """A' = A * sigmoid(rollout_seq_logp): ranking answers by their probability."""
    fn = rldsl.compile(_spec("normalizer", "    A = A * sigmoid(rollout_seq_logp)\n",
                             rest="  baseline  none\n"))
    adv = fn.estimate(R, 2, MASK, rollout_logprobs=ROLLOUT).advantages
    seq = torch.tensor(_seq(ROLLOUT))
    torch.testing.assert_close(adv[:, 0], R * torch.sigmoid(seq), rtol=1e-6, atol=1e-7)


def test_a_filter_reads_the_per_token_mismatch() -> None:
    """keep the rows whose largest per-token |rollout - old| is below 0.5 (row 2: 0.6; padding, 7.0 in row 0, is not read)."""
    fn = rldsl.compile(_spec("filter", "    keep = seq_max(abs(rollout_logp - old_logp)) < 0.5\n"))
    est = fn.estimate(R, 2, MASK, old_logprobs=OLD, rollout_logprobs=ROLLOUT)
    kept = est.mask.sum(-1) > 0
    assert kept.tolist() == [True, True, False, True]


def test_absent_or_misshapen_logprobs_fail_by_name() -> None:
    algo = _spec("shaping", "    r = r + 0.1 * old_seq_logp / L\n")
    assert algo.needs("advantage") == ["old_logprobs"]
    fn = rldsl.compile(algo)
    with pytest.raises(ValueError, match="needs old_logprobs="):
        fn.estimate(R, 2, MASK)
    with pytest.raises(ValueError, match=r"old_logprobs must be \[B, T\]"):
        fn.estimate(R, 2, MASK, old_logprobs=OLD[:, :2])
    rollout = rldsl.compile(_spec("normalizer", "    A = A * sigmoid(rollout_seq_logp)\n", rest=""))
    with pytest.raises(ValueError, match="needs rollout_logprobs="):
        rollout.estimate(R, 2, MASK)


def test_the_shapes_are_checked_like_every_input() -> None:
    """A per-sequence value where a slot needs one per sequence; a token value is refused there."""
    with pytest.raises(SpecError) as e:
        _spec("shaping", "    r = r + old_logp\n")
    assert "[B, T]" in e.value.render()
    assert lang.INPUTS["old_seq_logp"].rank == 1 and lang.INPUTS["old_logp"].rank == 2


@pytest.mark.parametrize("slot", ["shaping", "baseline", "normalizer", "filter"])
def test_every_advantage_slot_reads_them(slot: str) -> None:
    reads = lang.SLOTS[slot].inputs
    assert {"old_logp", "rollout_logp", "old_seq_logp", "rollout_seq_logp"} <= set(reads)


def test_a_spec_reading_none_of_them_needs_none_of_them() -> None:
    for name in rldsl.library():
        algo = rldsl.load(name)
        if "old_logprobs" in algo.needs("advantage"):  # a registry component that reads them (KL in reward)
            assert any(v.formula is None and "old_logprobs" in v.spec.facts.needs for v in algo.active("advantage"))
