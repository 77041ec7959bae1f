"""The reference model's reward of each row's prompt, `ref_reward` ([B], the prompt's value on its
G rows): read by advantage-stage and loss formulas, against hand-computed values (eager and
compiled); absent, misshapen or misplaced, it fails by name; a non-finite value takes its rows out
of the loss, as a failed reward does."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rldsl
from rldsl import SpecError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "algorithms" / "examples" / "contrastive_rewards.rl"
MASK = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
R = torch.tensor([1.0, 0.0, 1.0, 1.0])
# prompt 0 (rows 0, 1): the reference's answers scored 0.25 on average; prompt 1 (rows 2, 3): 1
REF = torch.tensor([0.25, 0.25, 1.0, 1.0])


def test_the_example_subtracts_the_reference_reward_before_the_batch_baseline() -> None:
    """contrastive_rewards: r' = r - ref_reward = (0.75, -0.25, 0, 0); A = r' - mean(r') = r' - 0.125."""
    algo = rldsl.load(str(EXAMPLE))
    assert algo.needs("advantage") == ["ref_reward"]
    for compiled in (False, True):
        fn = rldsl.compile(algo, compile=compiled)
        est = fn.estimate(R, 2, MASK, ref_reward=REF)
        want = torch.tensor([0.625, -0.375, -0.125, -0.125])
        torch.testing.assert_close(est.advantages, want[:, None] * MASK, rtol=0, atol=1e-7)
    plain = rldsl.compile(rldsl.load("reinforce"), compile=False).estimate(R, 2, MASK).advantages
    assert not torch.allclose(plain, est.advantages), "the reference's reward changes the advantages"


def test_a_loss_formula_reads_it_eager_and_compiled() -> None:
    """An objective weighting each sequence by its margin over the reference: l = -A * (r - ref) * logp."""
    algo = rldsl.loads("algorithm m extends reinforce\n  define margin\n    l = -A * (reward - ref_reward) * logp\n"
                       "  end\n  objective  margin\n", "m.rl")
    assert "ref_reward" in algo.needs("loss")
    logp = torch.log(torch.full((4, 3), 0.5))
    adv = torch.ones(4, 3)
    losses = []
    for compiled in (False, True):
        lp = logp.clone().requires_grad_(True)
        out = rldsl.compile(algo, compile=compiled).loss(lp, logp, adv, MASK, group_size=2, sequence_rewards=R,
                                                         ref_reward=REF)
        out.loss.backward()
        losses.append((out.loss.detach(), lp.grad))
    # seq_mean_token_sum: per sequence -sum_t (r - ref) logp_t, mean over the 4 sequences
    margin = R - REF
    want = -(margin[:, None] * logp * MASK).sum(-1).mean()
    for loss, grad in losses:
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, -(margin[:, None] * MASK) / 4, rtol=1e-6, atol=1e-7)


def test_absent_or_misshapen_it_fails_by_name() -> None:
    fn = rldsl.compile(rldsl.load(str(EXAMPLE)), compile=False)
    with pytest.raises(ValueError, match="needs ref_reward="):
        fn.estimate(R, 2, MASK)
    with pytest.raises(ValueError, match=r"ref_reward must be \[B\]"):
        fn.estimate(R, 2, MASK, ref_reward=REF[:3])
    with pytest.raises(ValueError, match=r"ref_reward must be \[B\]"):
        fn.estimate(R, 2, MASK, ref_reward=REF[:, None])


def test_a_failed_reference_reward_takes_its_rows_out_of_the_loss() -> None:
    """Prompt 1's reference answers all failed (NaN): its rows leave the loss and every statistic,
    exactly as if their own rewards had failed; the batch baseline is prompt 0's rows' mean."""
    fn = rldsl.compile(rldsl.load(str(EXAMPLE)), compile=False)
    est = fn.estimate(R, 2, MASK, ref_reward=torch.tensor([0.25, 0.25, float("nan"), float("nan")]))
    assert (est.mask.sum(-1) > 0).tolist() == [True, True, False, False]
    assert torch.isfinite(est.advantages).all()
    # r' = (0.75, -0.25) on the rows left, their mean 0.25
    torch.testing.assert_close(est.advantages[:2, 0], torch.tensor([0.5, -0.5]), rtol=0, atol=1e-7)
    failed = fn.estimate(torch.tensor([1.0, 0.0, float("nan"), float("nan")]), 2, MASK, ref_reward=REF)
    torch.testing.assert_close(est.advantages, failed.advantages, rtol=0, atol=0)
    torch.testing.assert_close(est.mask, failed.mask, rtol=0, atol=0)


def test_a_slot_that_does_not_receive_it_is_a_spec_error_at_its_position(tmp_path: Path) -> None:
    spec = tmp_path / "agg.rl"
    spec.write_text("algorithm x extends reinforce\n  define agg\n    weights = mask * ref_reward\n"
                    "    count = batch_sum(mask)\n  end\n  aggregation agg\n")
    with pytest.raises(SpecError) as e:
        rldsl.load(str(spec))
    text = str(e.value)
    assert f"{spec}:3:22" in text and "'ref_reward' is not an input of aggregation" in text and "^" in text


def test_a_misshapen_use_is_a_spec_error_at_its_position(tmp_path: Path) -> None:
    spec = tmp_path / "shape.rl"
    spec.write_text("algorithm x extends reinforce\n  define c\n    r = ref_reward * mask\n  end\n  shaping c\n")
    with pytest.raises(SpecError) as e:
        rldsl.load(str(spec))
    assert f"{spec}:3:9" in str(e.value) and "[B], got [B, T]" in str(e.value)


def test_explain_names_the_input_the_spec_reads() -> None:
    from rldsl.explain import explain_lines

    text = "\n".join("".join(t for t, _ in line) for line in explain_lines(rldsl.load(str(EXAMPLE))))
    assert "r = r - ref_reward" in text and "needs ref_reward=" in text
