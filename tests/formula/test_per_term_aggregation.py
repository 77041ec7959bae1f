"""Per-term aggregation: `kl k3(..., aggregation=token_mean)` aggregates the KL term on its own
(sum over every token / the token count) beside a policy loss aggregated per sequence (the
aggregation slot's seq_mean_token_mean). Loss and gradient against a hand-written reference, and
the same across micro-batch splits with the elementwise-summed [2] denominator; a spec without it
is unchanged (one count)."""
from __future__ import annotations

import pytest
import torch

import rldsl

SPEC = ("algorithm per_term extends grpo\n"
        "  kl           k3(beta=0.1, where=loss, aggregation=token_mean)\n"
        "  aggregation  seq_mean_token_mean\n")
MASK = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)
G = 2


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    logp = torch.log(0.1 + 0.8 * torch.rand(4, 4, generator=g, dtype=torch.float64))
    return dict(logp=logp, old=logp + 0.05 * torch.randn(4, 4, generator=g, dtype=torch.float64),
                ref=logp + 0.3 * torch.randn(4, 4, generator=g, dtype=torch.float64),
                adv=torch.randn(4, 1, generator=g, dtype=torch.float64).expand(4, 4) * MASK)


def _reference(logp: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """By hand: PPO clip 0.2 per token, each sequence's token mean then the mean over the 4
    sequences; plus 0.1 x the k3 KL summed over every response token / the 10 tokens."""
    rho = torch.exp(logp - b["old"])
    pg = torch.maximum(-b["adv"] * rho, -b["adv"] * torch.clamp(rho, 0.8, 1.2))
    per_seq = [sum(pg[i, t] for t in range(4) if MASK[i, t] > 0) / MASK[i].sum() for i in range(4)]
    x = b["ref"] - logp
    k3 = torch.exp(x) - x - 1
    kl = sum(k3[i, t] for i in range(4) for t in range(4) if MASK[i, t] > 0) / MASK.sum()
    return sum(per_seq) / 4 + 0.1 * kl


def _loss(fn: rldsl.CompiledAlgorithm, b: dict, rows: slice, denominator: torch.Tensor | None):
    lp = b["logp"][rows].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"][rows], b["adv"][rows], MASK[rows], ref_logprobs=b["ref"][rows],
                  group_size=G, denominator=denominator)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out.loss, grad


def test_a_per_sequence_term_beside_a_token_mean_kl_equals_the_hand_reference() -> None:
    fn = rldsl.compile(rldsl.loads(SPEC), compile=False)
    b = _batch()
    loss, grad = _loss(fn, b, slice(None), None)
    lp = b["logp"].clone().requires_grad_(True)
    want = _reference(lp, b)
    (want_grad,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    # the same term through the aggregation slot (no aggregation=) is a different loss: one count
    one = rldsl.compile(rldsl.loads(SPEC.replace(", aggregation=token_mean", "")), compile=False)
    assert float(one.denominator(MASK, G)) == 4.0
    assert not torch.allclose(_loss(one, b, slice(None), None)[0], loss)


def test_micro_batches_sum_to_the_whole_batch_with_a_denominator_per_term() -> None:
    """Split 2 + 2 rows: each micro-batch's loss over the global [2] denominator (the elementwise
    sum of the local ones: 4 sequences, 10 tokens); the summed losses and gradients equal one call."""
    fn = rldsl.compile(rldsl.loads(SPEC), compile=False)
    b = _batch()
    halves = (slice(0, 2), slice(2, 4))
    local = [fn.denominator(MASK[h], G) for h in halves]
    assert [d.tolist() for d in local] == [[2.0, 4.0], [2.0, 6.0]]
    total = local[0] + local[1]
    assert total.tolist() == fn.denominator(MASK, G).tolist() == [4.0, 10.0]
    whole_loss, whole_grad = _loss(fn, b, slice(None), total)
    parts = [_loss(fn, b, h, total) for h in halves]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), whole_grad, rtol=1e-12, atol=1e-12)
    # a local denominator in each micro-batch would weigh the halves' tokens wrongly
    wrong = sum(_loss(fn, b, h, None)[0] for h in halves)
    assert not torch.allclose(wrong, whole_loss)


def test_the_option_is_for_a_kl_term_in_the_loss_and_a_known_aggregation() -> None:
    with pytest.raises(rldsl.SpecError, match="aggregation"):
        rldsl.loads(SPEC.replace("token_mean)", "per_galaxy)"))
