"""The masked reductions formulas compile to, against plain Python over the valid entries only.
Padding holds inf and NaN: a reduction that read it would show it."""
from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rldsl.formula import masked as fx

SETTINGS = settings(max_examples=40, deadline=None)
HOW = ["sum", "mean", "std", "max", "min", "quantile"]


def ref(values: list[float], how: str, q: float = 0.5) -> float:
    """The reduction of a plain list, with the empty / singleton conventions of docs/formulas.md."""
    if how == "sum":
        return float(sum(values))
    if not values:
        return 1.0 if how == "std" else 0.0
    if how == "mean":
        return statistics.fmean(values)
    if how == "std":
        return statistics.stdev(values) if len(values) > 1 else 1.0
    if how == "max":
        return max(values)
    if how == "min":
        return min(values)
    s = sorted(values)  # linear interpolation, as torch.quantile
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@st.composite
def padded(draw):
    P, G, T = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
    B = P * G
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).double()
    x[mask == 0] = float("inf")
    x[(mask == 0) & (torch.rand(B, T, generator=g) < 0.5)] = float("nan")
    rows = (torch.rand(B, generator=g) > 0.3).double()
    r = torch.randn(B, generator=g, dtype=torch.float64)
    r[rows == 0] = float("nan")  # a failed reward's row
    return x, mask, r, rows, G, draw(st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]))


@SETTINGS
@given(padded(), st.sampled_from(HOW))
def test_seq_reductions_read_only_tokens(case, how):
    x, mask, _, _, _, q = case
    fn = getattr(fx, f"seq_{how}")
    got = fn(x, q, mask) if how == "quantile" else fn(x, mask)
    for i in range(x.shape[0]):
        vals = [float(x[i, t]) for t in range(x.shape[1]) if mask[i, t] > 0]
        assert float(got[i]) == pytest.approx(ref(vals, how, q), rel=1e-9, abs=1e-12)


@SETTINGS
@given(padded(), st.sampled_from(HOW))
def test_group_reductions_read_only_valid_rows(case, how):
    _, _, r, rows, G, q = case
    fn = getattr(fx, f"group_{how}")
    got = fn(r, q, rows, G) if how == "quantile" else fn(r, rows, G)
    for i in range(r.shape[0]):
        g = i // G
        vals = [float(r[j]) for j in range(g * G, (g + 1) * G) if rows[j] > 0]
        assert float(got[i]) == pytest.approx(ref(vals, how, q), rel=1e-9, abs=1e-12)


@SETTINGS
@given(padded(), st.sampled_from(HOW))
def test_batch_reductions_over_tokens_and_over_rows(case, how):
    x, mask, r, rows, _, q = case
    fn = getattr(fx, f"batch_{how}")
    tokens = [float(v) for v, m in zip(x.flatten(), mask.flatten()) if m > 0]
    got = fn(x, q, mask) if how == "quantile" else fn(x, mask)
    assert got.shape == () and float(got) == pytest.approx(ref(tokens, how, q), rel=1e-9, abs=1e-12)
    valid = [float(v) for v, k in zip(r, rows) if k > 0]
    got = fn(r, q, rows) if how == "quantile" else fn(r, rows)
    assert float(got) == pytest.approx(ref(valid, how, q), rel=1e-9, abs=1e-12)


def test_constants_are_spread_over_the_entries_first() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    rows = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert fx.seq_sum(1.0, mask).tolist() == [2.0, 0.0, 1.0, 3.0]  # L
    assert fx.group_sum(1.0, rows, 2).tolist() == [1.0, 1.0, 2.0, 2.0]  # valid members
    assert float(fx.batch_sum(1.0, rows)) == 3.0  # valid rows
    assert float(fx.batch_sum(mask, mask)) == 6.0  # tokens
    assert fx.seq_mean(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask).tolist() == [1.0, 0.0, 3.0, 4.0]


def test_gradients_do_not_reach_padding_and_stay_finite() -> None:
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), float("nan")]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    total = sum(getattr(fx, f"seq_{h}")(x, mask).sum() for h in ("sum", "mean", "std", "max", "min"))
    total = total + fx.seq_quantile(x, 0.5, mask).sum() + fx.batch_std(x, mask)
    total.backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[mask == 0] == 0).all()


def test_spread_and_sizes() -> None:
    mask = torch.ones(3, 4, dtype=torch.float64)
    assert fx.spread(torch.tensor([1.0, 2.0, 3.0]), mask).shape == (3, 4)
    assert fx.spread(2.0, mask).dtype == torch.float64
    assert fx.spread(torch.tensor([True, False, True]), torch.zeros(3)).tolist() == [1.0, 0.0, 1.0]
    assert float(fx.size(mask, 0)) == 3.0 and float(fx.size(mask, 1)) == 4.0
    assert fx.scalar(5, mask).dtype == torch.float64
