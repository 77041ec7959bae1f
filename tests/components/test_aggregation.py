"""aggregation slot against verl agg_loss / TRL loss_type / ScaleRL prompt-level averaging.

Through a spec with ``objective reinforce`` and A = -1 the per-token loss is logp itself, so
``fn.loss`` is the aggregation of logp and its gradient is the per-token weight / count.
"""
from __future__ import annotations

import pytest
import torch

from component_refs import assert_close, lists, random_batch, ref_aggregate, ref_token_weights, spec_fn
from rldsl.components import aggregation as ag

# (spec line, reference mode, reference kwargs)
AGGREGATIONS = [
    ("token_mean", "token_mean", {}),
    ("seq_mean_token_mean", "seq_mean_token_mean", {}),
    ("seq_mean_token_mean(count_empty=true)", "seq_mean_token_mean", {"count_empty": True}),
    ("seq_mean_token_sum", "seq_mean_token_sum", {}),
    ("seq_mean_token_sum(count_empty=true)", "seq_mean_token_sum", {"count_empty": True}),
    ("token_sum_norm(max_tokens=8)", "token_sum_norm", {"max_tokens": 8}),
    ("prompt_mean", "prompt_mean", {}),
]
IDS = [a[0] for a in AGGREGATIONS]

# l = per-token loss; lengths 3, 1, 0 (fully masked), 2; G = 2
L_HAND = [[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0], [5.0, 6.0, 9.0]]
M_HAND = [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]]
HAND = {  # computed by hand
    "token_mean": 21 / 6,                              # all tokens / 6 tokens
    "seq_mean_token_mean": (2 + 4 + 5.5) / 3,          # empty row not counted
    "seq_mean_token_mean(count_empty=true)": (2 + 4 + 5.5) / 4,
    "seq_mean_token_sum": (6 + 4 + 11) / 3,
    "seq_mean_token_sum(count_empty=true)": (6 + 4 + 11) / 4,
    "token_sum_norm(max_tokens=8)": 21 / (4 * 8),      # Dr. GRPO: B * L_max, empty rows count
    "prompt_mean": ((6 + 4) / 4 + 11 / 2) / 2,         # group token means 2.5 and 5.5
}
COUNTS = {"token_mean": 6, "seq_mean_token_mean": 3, "seq_mean_token_mean(count_empty=true)": 4,
          "seq_mean_token_sum": 3, "seq_mean_token_sum(count_empty=true)": 4,
          "token_sum_norm(max_tokens=8)": 4, "prompt_mean": 2}


def agg_fn(line: str):
    return spec_fn(f"objective reinforce\naggregation {line}")


def loss_of(fn, per_token, mask, G=2, **kw):
    """fn.loss with per-token loss = logp (A = -1); returns (loss, d loss / d per_token)."""
    lp = per_token.clone().requires_grad_(True)
    out = fn.loss(lp, lp.detach(), -torch.ones_like(lp), mask, group_size=G, **kw)
    (g,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), g


@pytest.mark.parametrize("line", IDS)
def test_hand_numbers(line):
    fn = agg_fn(line)
    mask = torch.tensor(M_HAND, dtype=torch.float32)
    loss, _ = loss_of(fn, torch.tensor(L_HAND), mask)
    assert float(loss) == pytest.approx(HAND[line], rel=1e-6)
    assert float(fn.denominator(mask, 2)) == COUNTS[line]


@pytest.mark.parametrize("line,mode,kw", AGGREGATIONS, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_value_and_gradient_match_loop_reference(line, mode, kw, seed):
    b = random_batch(6, 7, seed, empty_rows=(4,))
    fn = agg_fn(line)
    loss, grad = loss_of(fn, b["logp"], b["mask"], G=3)
    m, l_ = lists(b["mask"]), lists(b["logp"])
    assert float(loss) == pytest.approx(ref_aggregate(l_, m, mode, 3, **kw), rel=1e-5)
    assert_close(grad, ref_token_weights(m, mode, 3, **kw))


@pytest.mark.parametrize("line", IDS)
def test_component_weights_and_count(line):
    """The component's (weights, count): loss = sum(l * weights) / count, weights 0 on padding."""
    fn = agg_fn(line)
    val = fn.algorithm["aggregation"]
    comp = getattr(ag, val.component)
    mask = torch.tensor(M_HAND, dtype=torch.float32)
    w, n = comp(mask, 2, **val.spec.fn_params(val.params))
    assert n.shape == () and float(n) == COUNTS[line]
    assert torch.count_nonzero(w[mask == 0]) == 0
    assert float((torch.tensor(L_HAND) * w).sum() / n) == pytest.approx(HAND[line], rel=1e-6)


@pytest.mark.parametrize("line", IDS)
def test_all_masked_batch_gives_zero_loss_and_zero_grads(line):
    fn = agg_fn(line)
    lp = torch.randn(4, 5)
    loss, grad = loss_of(fn, lp, torch.zeros(4, 5))
    assert float(loss) == 0.0
    assert torch.count_nonzero(grad) == 0 and torch.isfinite(grad).all()


@pytest.mark.parametrize("line", IDS)
def test_fully_masked_row_contributes_nothing(line):
    fn = agg_fn(line)
    mask = torch.tensor(M_HAND, dtype=torch.float32)
    l1 = torch.tensor(L_HAND)
    l2 = l1.clone()
    l2[2] = 1e6  # the empty row's values do not matter
    a, g = loss_of(fn, l1, mask)
    b, _ = loss_of(fn, l2, mask)
    assert float(a) == float(b)
    assert torch.count_nonzero(g[2]) == 0


def test_dr_grpo_constant_does_not_depend_on_padding_length():
    """verl's default loss_scale_factor is the padded length; ours is the constant L_max
    (TRL dr_grpo: sum / (B * max_completion_length))."""
    fn = agg_fn("token_sum_norm(max_tokens=8)")
    mask = torch.tensor(M_HAND, dtype=torch.float32)
    l_ = torch.tensor(L_HAND)
    short, _ = loss_of(fn, l_, mask)
    long_, _ = loss_of(fn, torch.cat([l_, torch.ones(4, 5)], 1), torch.cat([mask, torch.zeros(4, 5)], 1))
    assert float(short) == float(long_) == pytest.approx(21 / 32)
    trl = sum(x * m for rl, rm in zip(L_HAND, M_HAND) for x, m in zip(rl, rm)) / (4 * 8)
    assert float(short) == pytest.approx(trl)


def test_prompt_mean_skips_an_empty_group_and_needs_group_size():
    fn = agg_fn("prompt_mean")
    mask = torch.tensor([[1, 1], [1, 0], [0, 0], [0, 0]], dtype=torch.float32)
    loss, _ = loss_of(fn, torch.tensor([[1.0, 2.0], [6.0, 0.0], [5.0, 5.0], [5.0, 5.0]]), mask)
    assert float(loss) == pytest.approx(3.0)  # only group 0: (1+2+6)/3
    assert float(fn.denominator(mask, 2)) == 1
    with pytest.raises(ValueError, match="group_size"):
        fn.denominator(mask)
    with pytest.raises(ValueError, match="group_size"):
        fn.loss(torch.zeros(4, 2), torch.zeros(4, 2), torch.zeros(4, 2), mask)


def test_prompt_mean_differs_from_token_mean_when_groups_differ_in_length():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)
    l_ = torch.tensor([[1.0] * 4, [1.0] * 4, [3.0] * 4, [3.0] * 4])
    pm, _ = loss_of(agg_fn("prompt_mean"), l_, mask)
    tm, _ = loss_of(agg_fn("token_mean"), l_, mask)
    assert float(pm) == pytest.approx(2.0)       # (1 + 3) / 2: prompts weigh equally
    assert float(tm) == pytest.approx(14 / 10)   # tokens weigh equally
