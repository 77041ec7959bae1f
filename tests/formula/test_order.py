"""Order operations of the formula language (sort, rank, cumsum, topk_mask over a sequence's
tokens, a group's rows or the batch): hand-computed values; properties against a plain-Python
stable sort over the valid entries only (hypothesis: ties, padding holding inf / NaN, empty
rows and groups, permutations); quantile levels that are expressions; and the three methods
they make writable (issue 47 item 1), each against a hand-written torch reference built on a
stable argsort, value and gradient to 1e-6, eager and compiled."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rldsl
from rldsl.formula import masked as fx

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "tests" / "specs" / "formula"
GFPO = str(ROOT / "algorithms" / "examples" / "gfpo.rl")
QUANTILE_OF_G = str(SPECS / "order_quantile_of_g.rl")
BUDGET = str(SPECS / "order_budget_trust_region.rl")
ALL_OPS = str(SPECS / "order_loss_ops.rl")
SETTINGS = settings(max_examples=60, deadline=None)
OPS = ["sort", "rank", "cumsum", "topk_mask"]

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
needs_compile = pytest.mark.compile  # compiled where RLDSL_COMPILE allows it, else skipped (tests/conftest.py)

T_ = True
F_ = False


# ---------------------------------------------------------------- hand-computed values

def test_seq_operations_by_hand() -> None:
    x = torch.tensor([[3.0, 1.0, 2.0, float("inf")], [5.0, 5.0, 1.0, float("nan")]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 0]])
    assert fx.seq_rank(x, mask).tolist() == [[2, 0, 1, 0], [1, 2, 0, 0]]  # the tie: earlier ranks lower
    assert fx.seq_sort(x, mask).tolist() == [[1, 2, 3, 0], [1, 5, 5, 0]]
    assert fx.seq_cumsum(x, mask).tolist() == [[3, 4, 6, 0], [5, 10, 11, 0]]
    assert fx.seq_topk_mask(x, 2.0, mask).tolist() == [[T_, F_, T_, F_], [T_, T_, F_, F_]]
    assert fx.seq_topk_mask(x, 1.0, mask).tolist() == [[T_, F_, F_, F_], [T_, F_, F_, F_]]  # the earlier 5
    assert fx.seq_topk_mask(x, 9.0, mask).tolist() == [[T_, T_, T_, F_]] * 2  # k > n: every valid token
    assert fx.seq_topk_mask(x, 0.0, mask).sum() == 0
    # a hole in the mask is skipped: the sorted values fill the valid positions in order
    holed = torch.tensor([[1.0, 0, 1, 1]])
    assert fx.seq_sort(torch.tensor([[4.0, 9, 2, 3]]), holed).tolist() == [[2, 0, 3, 4]]
    assert fx.seq_cumsum(torch.tensor([[4.0, 9, 2, 3]]), holed).tolist() == [[4, 0, 6, 9]]
    # a constant is spread over the tokens first: cumsum(1) counts the valid tokens so far
    assert fx.seq_cumsum(1.0, mask).tolist() == [[1, 2, 3, 0]] * 2


def test_group_operations_by_hand() -> None:
    x = torch.tensor([2.0, 7.0, 7.0, float("nan"), 4.0, 4.0, 4.0, 4.0])
    rows = torch.tensor([1.0, 1, 1, 0, 1, 1, 1, 1])  # row 3's reward failed: it takes no part
    assert fx.group_rank(x, rows, 4).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert fx.group_sort(x, rows, 4).tolist() == [2, 7, 7, 0, 4, 4, 4, 4]
    assert fx.group_cumsum(x, rows, 4).tolist() == [2, 9, 16, 0, 4, 8, 12, 16]
    assert fx.group_topk_mask(x, 1.0, rows, 4).tolist() == [F_, T_, F_, F_, T_, F_, F_, F_]
    assert fx.group_topk_mask(x, 2.0, rows, 4).tolist() == [F_, T_, T_, F_, T_, T_, F_, F_]
    # a tensor k (an expression such as G / 2) is the same as the number
    k = torch.tensor(2.0)
    assert fx.group_topk_mask(x, k, rows, 4).tolist() == fx.group_topk_mask(x, 2.0, rows, 4).tolist()
    # an empty group: every value 0, nothing kept
    empty = torch.zeros(8)
    for op in ("rank", "sort", "cumsum"):
        assert getattr(fx, f"group_{op}")(x, empty, 4).tolist() == [0.0] * 8
    assert not fx.group_topk_mask(x, 3.0, empty, 4).any()


def test_batch_operations_by_hand() -> None:
    x = torch.tensor([[3.0, 1.0, float("inf")], [2.0, 9.0, float("-inf")]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 0]])
    # tokens, row by row: 3, 1, 2, 9
    assert fx.batch_rank(x, mask).tolist() == [[2, 0, 0], [1, 3, 0]]
    assert fx.batch_sort(x, mask).tolist() == [[1, 2, 0], [3, 9, 0]]
    assert fx.batch_cumsum(x, mask).tolist() == [[3, 4, 0], [6, 15, 0]]
    assert fx.batch_topk_mask(x, 2.0, mask).tolist() == [[T_, F_, F_], [F_, T_, F_]]
    # rows
    r = torch.tensor([1.0, 0.0, 1.0, 0.5])
    rows = torch.tensor([1.0, 1, 1, 0])
    assert fx.batch_rank(r, rows).tolist() == [1, 0, 2, 0]
    assert fx.batch_topk_mask(r, 1.0, rows).tolist() == [T_, F_, F_, F_]
    assert fx.batch_sort(r, rows).tolist() == [0, 1, 1, 0]
    # a valid inf is still a valid entry, sorted after the finite ones and before no padding
    y = torch.tensor([[float("inf"), 1.0, 5.0]])
    assert fx.batch_rank(y, torch.tensor([[1.0, 1, 0]])).tolist() == [[1, 0, 0]]


def test_quantile_levels_may_be_expressions() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(8, 5, generator=g) > 0.3).double()
    rows = torch.ones(8, dtype=torch.float64)
    for q in (0.0, 0.25, 0.75, 1.0):
        t = torch.tensor(q, dtype=torch.float64)
        assert torch.equal(fx.seq_quantile(x, t, mask), fx.seq_quantile(x, q, mask))
        assert torch.equal(fx.group_quantile(x[:, 0], t, rows, 4), fx.group_quantile(x[:, 0], q, rows, 4))
        assert torch.equal(fx.batch_quantile(x, t, mask), fx.batch_quantile(x, q, mask))
    # clamped to [0, 1]; float32 levels on float64 values; no gradient through the level
    assert torch.equal(fx.batch_quantile(x, torch.tensor(1.5), mask), fx.batch_quantile(x, 1.0, mask))
    assert torch.equal(fx.batch_quantile(x, torch.tensor(-2.0), mask), fx.batch_quantile(x, 0.0, mask))
    # in a formula: a level of G and of a parameter, the same for every group size
    text = ("algorithm o extends grpo\n  define qn\n    k = 2\n"
            "    A = A / (group_quantile(abs(r - group_mean(r)), (k - 1) / max(G - 1, 1)) + 0.5)\n"
            "  end\n  normalizer qn\n")
    fn = rldsl.compile(rldsl.loads(text), compile=False)
    assert ("fx.group_quantile(torch.abs(r - fx.group_mean(r, no_rows, group_size)), "
            "1.0 / torch.clamp(no_G - 1.0, min=1.0), no_rows, group_size)") in fn.advantages_source
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 0, 1, 0, 0, 0], dtype=torch.float64)
    m = torch.ones(12, 3, dtype=torch.float64)
    for G in (3, 4, 6):
        level = 1.0 / (G - 1)  # (k - 1) / (G - 1), by hand
        dev = (r - r.view(-1, G).mean(-1).repeat_interleave(G)).abs()
        cut = torch.quantile(dev.view(-1, G), level, dim=-1).repeat_interleave(G)
        centred = r - r.view(-1, G).mean(-1).repeat_interleave(G)  # grpo's baseline; this normalizer
        want = (centred / (cut + 0.5)).unsqueeze(-1).expand(12, 3)  # (the stage computes in float32)
        torch.testing.assert_close(fn.estimate(r, G, m).advantages.double(), want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- properties (hypothesis)

def ref_unit(vals: list[float], op: str, k: int) -> list[float]:
    """The operation on one unit's valid values (in position order), by Python's stable sort."""
    n = len(vals)
    order = sorted(range(n), key=lambda i: vals[i])  # stable: ties keep position order
    if op == "sort":
        return [vals[order[j]] for j in range(n)]
    if op == "rank":
        rank = [0.0] * n
        for pos, i in enumerate(order):
            rank[i] = float(pos)
        return rank
    if op == "cumsum":
        out, s = [], 0.0
        for v in vals:
            s += v
            out.append(s)
        return out
    top = set(sorted(range(n), key=lambda i: -vals[i])[:k])
    return [1.0 if i in top else 0.0 for i in range(n)]


def ref_scope(x: torch.Tensor, valid: torch.Tensor, op: str, k: int, units: list[list[tuple]]) -> torch.Tensor:
    """``op`` over each unit (a list of indices into x, in position order); padding 0."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for unit in units:
        idx = [i for i in unit if valid[i] > 0]
        for i, v in zip(idx, ref_unit([float(x[i]) for i in idx], op, k)):
            out[i] = v
    return out


@st.composite
def padded(draw):
    P, G, T = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 6))
    B = P * G
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ties = draw(st.booleans())
    x = (torch.randint(0, 3, (B, T), generator=g).double() if ties
         else torch.randn(B, T, generator=g, dtype=torch.float64))
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).double()
    x[mask == 0] = float("inf")
    x[(mask == 0) & (torch.rand(B, T, generator=g) < 0.5)] = float("nan")
    rows = (torch.rand(B, generator=g) > 0.3).double()
    r = torch.randint(0, 3, (B,), generator=g).double() if ties else torch.randn(B, generator=g, dtype=torch.float64)
    r[rows == 0] = float("nan")  # a failed reward's row
    return x, mask, r, rows, G, draw(st.integers(0, 5))


def _call(scope: str, op: str, x, valid, G: int, k: int):  # noqa: ANN001, ANN202
    f = getattr(fx, f"{scope}_{op}")
    args = (x, float(k)) if op == "topk_mask" else (x,)
    return f(*args, valid, G) if scope == "group" else f(*args, valid)


@SETTINGS
@given(padded(), st.sampled_from(OPS))
def test_order_operations_equal_a_stable_sort_over_the_valid_entries(case, op) -> None:
    x, mask, r, rows, G, k = case
    B, T = x.shape
    cases = [  # (scope, values, valid, units of (index) in position order)
        ("seq", x, mask, [[(b, t) for t in range(T)] for b in range(B)]),
        ("group", r, rows, [[(i,) for i in range(p * G, p * G + G)] for p in range(B // G)]),
        ("batch", r, rows, [[(i,) for i in range(B)]]),
        ("batch", x, mask, [[(b, t) for b in range(B) for t in range(T)]]),
    ]
    for scope, values, valid, units in cases:
        got = _call(scope, op, values, valid, G, k)
        assert got.shape == values.shape
        want = ref_scope(values, valid, op, k, units)
        if op == "topk_mask":
            assert got.dtype == torch.bool
            assert got.double().tolist() == want.tolist(), (scope, op)
        else:
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert not got[valid == 0].bool().any(), "padding gets 0 / false"
        for unit in units:  # invariants, stated directly
            idx = [i for i in unit if valid[i] > 0]
            vals = [float(got[i]) for i in idx]
            if op == "rank":  # a permutation of 0..n-1, ties in position order
                assert sorted(vals) == [float(j) for j in range(len(idx))]
                for a, b in zip(idx, idx[1:]):
                    if float(values[a]) == float(values[b]):
                        assert float(got[a]) < float(got[b])
            if op == "sort":  # ascending, the same multiset
                assert vals == sorted(vals) and vals == sorted(float(values[i]) for i in idx)
            if op == "topk_mask":
                assert sum(vals) == min(k, len(idx))


@SETTINGS
@given(padded(), st.integers(0, 2**31 - 1))
def test_permuting_the_rows_permutes_the_ranks(case, seed) -> None:
    """rank's multiset does not depend on the order of the entries; with distinct values each
    entry keeps its rank wherever it stands; sort's valid values are the same sequence."""
    _, _, r, rows, _, _ = case
    B = r.shape[0]
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
    rank, prank = fx.batch_rank(r, rows), fx.batch_rank(r[perm], rows[perm])
    v, pv = rows > 0, rows[perm] > 0
    assert sorted(rank[v].tolist()) == sorted(prank[pv].tolist())
    if len(set(r[v].tolist())) == int(v.sum()):
        assert torch.equal(prank, rank[perm])
    assert fx.batch_sort(r, rows)[v].tolist() == fx.batch_sort(r[perm], rows[perm])[pv].tolist()


@SETTINGS
@given(padded())
def test_sort_and_cumsum_gradients_follow_the_entries(case) -> None:
    """d sort / d x routes each output's gradient to the entry it came from (stable order);
    d cumsum / d x_i sums the weights of the entries at and after i; padding gets none."""
    x, mask, _, _, _, _ = case
    B, T = x.shape
    x = x.clone().requires_grad_(True)
    wts = torch.randn(B, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for scope in ("seq", "batch"):
        (gs,) = torch.autograd.grad((_call(scope, "sort", x, mask, 1, 0) * wts).sum(), x)
        (gc,) = torch.autograd.grad((_call(scope, "cumsum", x, mask, 1, 0) * wts).sum(), x)
        units = ([[(b, t) for t in range(T)] for b in range(B)] if scope == "seq"
                 else [[(b, t) for b in range(B) for t in range(T)]])
        want_s = torch.zeros(B, T, dtype=torch.float64)
        want_c = torch.zeros(B, T, dtype=torch.float64)
        for unit in units:
            idx = [i for i in unit if mask[i] > 0]
            order = sorted(range(len(idx)), key=lambda j: float(x.detach()[idx[j]]))
            for pos, j in enumerate(order):  # the pos-th smallest sits at the pos-th valid entry
                want_s[idx[j]] = wts[idx[pos]]
            for j, i in enumerate(idx):
                want_c[i] = sum(float(wts[a]) for a in idx[j:])
        torch.testing.assert_close(gs, want_s, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gc, want_c, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- the methods they make writable

def grpo_loss_ref(logp, old, ref, adv, mask):  # noqa: ANN001, ANN201
    """GRPO's loss by hand: PPO clip 0.2, k3 KL (beta 0.04), each sequence's token mean, then the
    mean over the sequences with tokens."""
    rho = torch.exp(logp - old)
    pg = torch.maximum(-adv * rho, -adv * torch.clamp(rho, 0.8, 1.2))
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    per_token = (pg + 0.04 * k3) * mask
    L = mask.sum(-1)
    return (per_token.sum(-1) / L.clamp_min(1)).sum() / (L > 0).sum()


def gfpo_advantages_ref(r, mask, G: int, k: int, metric: str, eps: float = 1e-6):  # noqa: ANN001, ANN201
    """GFPO by hand: per group, the k answers first in a stable argsort of the metric (length
    ascending, or reward per token descending) keep (r - mean_S) / (std_S + eps); others 0."""
    L = mask.sum(-1)
    A = torch.zeros_like(r)
    for p in range(r.shape[0] // G):
        idx = torch.arange(p * G, p * G + G)
        key = L[idx] if metric == "length" else -(r[idx] / L[idx].clamp_min(1))
        kept = idx[torch.argsort(key, stable=True)[:k]]
        rk = r[kept]
        A[kept] = (rk - rk.mean()) / (rk.std() + eps)
    return A


def _loss_and_grad(fn, logp, old, ref, adv, mask, G):  # noqa: ANN001, ANN202
    lp = logp.clone().requires_grad_(True)
    out = fn.loss(lp, old, adv, mask, ref_logprobs=ref, group_size=G)
    return out.loss, torch.autograd.grad(out.loss, lp)[0]


def _batch(B: int, T: int, seed: int, lengths: list[int] | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    logp = torch.log(0.05 + 0.9 * torch.rand(B, T, generator=g, dtype=torch.float64))
    lens = torch.tensor(lengths) if lengths is not None else torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T).expand(B, T) < lens.unsqueeze(-1)).double()
    return dict(logp=logp, old=logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
                ref=logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64), mask=mask,
                r=(torch.rand(B, generator=g) > 0.5).double())


# lengths with ties inside groups of 4 (and of 8): a quantile cut keeps every tied answer
TIED = [3, 2, 2, 5, 4, 4, 4, 1, 6, 2, 6, 2, 3, 3, 3, 3]


@pytest.mark.parametrize("metric", ["length", "efficiency"])
@pytest.mark.parametrize("G,k", [(4, 2), (8, 3)])
def test_gfpo_keeps_exactly_k_answers_as_a_stable_sort(metric: str, G: int, k: int) -> None:
    text = Path(GFPO).read_text()
    if metric == "efficiency":
        text = text.replace("group_topk_mask(-L, k)", "group_topk_mask(r / max(L, 1), k)")
    text = text.replace("baseline      gfpo_retain\n", f"baseline      gfpo_retain(k={k})\n")
    fn = rldsl.compile(rldsl.loads(text, filename="gfpo.rl"), compile=False)
    b = _batch(16, 7, seed=G + k, lengths=TIED)
    if metric == "efficiency":  # reward-per-token ties: 0 / L for every wrong answer
        b["r"][:] = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0], dtype=torch.float64)
    adv = fn.estimate(b["r"], G, b["mask"]).advantages.double()  # (the stage computes in float32)
    want = gfpo_advantages_ref(b["r"], b["mask"], G, k, metric)
    torch.testing.assert_close(adv, want.unsqueeze(-1) * b["mask"], rtol=1e-6, atol=1e-6)
    kept = (adv.abs().sum(-1) > 0).view(-1, G).sum(-1)
    assert (kept <= k).all()
    loss, grad = _loss_and_grad(fn, b["logp"], b["old"], b["ref"], adv, b["mask"], G)
    lp = b["logp"].clone().requires_grad_(True)
    ref_loss = grpo_loss_ref(lp, b["old"], b["ref"], want.unsqueeze(-1) * b["mask"], b["mask"])
    (ref_grad,) = torch.autograd.grad(ref_loss, lp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)


def test_a_quantile_cut_keeps_ties_where_topk_mask_keeps_exactly_k() -> None:
    """The finding: the k-th shortest as a quantile keeps every answer tied with it."""
    mask = (torch.arange(7).expand(16, 7) < torch.tensor(TIED).unsqueeze(-1)).double()
    r = torch.ones(16, dtype=torch.float64)
    cut = rldsl.compile(rldsl.load(QUANTILE_OF_G), compile=False).estimate(r, 4, mask)
    kept_cut = (cut.mask.sum(-1) > 0).view(-1, 4).sum(-1)
    topk = fx.group_topk_mask(-mask.sum(-1), 2.0, torch.ones(16, dtype=torch.float64), 4)
    assert topk.view(-1, 4).sum(-1).tolist() == [2, 2, 2, 2]
    assert kept_cut.tolist() == [2, 4, 2, 4]  # groups with ties at the 2nd shortest keep more


@pytest.mark.parametrize("G", [4, 8])
def test_a_quantile_level_of_g_needs_no_level_per_group_size(G: int) -> None:
    b = _batch(16, 7, seed=G, lengths=TIED)
    fn = rldsl.compile(rldsl.load(QUANTILE_OF_G), compile=False)
    est = fn.estimate(b["r"], G, b["mask"])
    est.advantages, est.mask = est.advantages.double(), est.mask.double()  # (the stage's float32)
    L = b["mask"].sum(-1)
    cut = torch.quantile(L.view(-1, G), 1.0 / (G - 1), dim=-1).repeat_interleave(G)  # k = 2, by hand
    keep = (L <= cut).double()
    torch.testing.assert_close(est.mask, b["mask"] * keep.unsqueeze(-1), rtol=0, atol=0)
    # the level written by hand for this G gives the same spec
    by_hand = Path(QUANTILE_OF_G).read_text().replace("(k - 1) / max(G - 1, 1)", repr(1.0 / (G - 1))).replace(
        "    k = 2\n", "")
    est2 = rldsl.compile(rldsl.loads(by_hand), compile=False).estimate(b["r"], G, b["mask"])
    est2.advantages, est2.mask = est2.advantages.double(), est2.mask.double()
    torch.testing.assert_close(est.advantages, est2.advantages, rtol=0, atol=0)
    torch.testing.assert_close(est.mask, est2.mask, rtol=0, atol=0)
    loss, grad = _loss_and_grad(fn, b["logp"], b["old"], b["ref"], est.advantages, est.mask, G)
    lp = b["logp"].clone().requires_grad_(True)
    ref_loss = grpo_loss_ref(lp, b["old"], b["ref"], est2.advantages, b["mask"] * keep.unsqueeze(-1))
    (ref_grad,) = torch.autograd.grad(ref_loss, lp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)


def budget_loss_ref(logp, old, adv, mask, budget: float = 0.6):  # noqa: ANN001, ANN201
    """The divergence-budget trust region by hand: flatten the valid tokens row by row, stable
    argsort, cumulative sum until budget * total, the value there is the bound; tokens above it
    keep rho's value without its gradient; PPO objective, token mean."""
    v = (logp - old).abs().detach()
    flat = v[mask > 0]
    s = flat[torch.argsort(flat, stable=True)]
    c = torch.cumsum(s, 0)
    j = int(torch.nonzero(c >= budget * flat.sum())[0])
    bound = s[j]
    rho = torch.exp(logp - old)
    w = torch.where(v <= bound, rho, rho.detach())
    return (-adv * w * mask).sum() / mask.sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_trust_region_bound_from_the_sorted_tokens_of_the_batch(seed: int) -> None:
    b = _batch(8, 9, seed)
    g = torch.Generator().manual_seed(100 + seed)
    adv = torch.randn(8, 9, generator=g, dtype=torch.float64) * b["mask"]
    fn = rldsl.compile(rldsl.load(BUDGET), compile=False)
    loss, grad = _loss_and_grad(fn, b["logp"], b["old"], b["ref"], adv, b["mask"], 4)
    lp = b["logp"].clone().requires_grad_(True)
    ref_loss = budget_loss_ref(lp, b["old"], adv, b["mask"])
    (ref_grad,) = torch.autograd.grad(ref_loss, lp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)
    cut = (grad == 0) & (b["mask"] > 0) & (adv != 0)
    assert 0 < int(cut.sum()) < int((b["mask"] > 0).sum()), "the budget stops some tokens' gradient"


@pytest.mark.slow  # torch.compile of the spec: tens of seconds on a busy 2-core machine
@needs_compile
def test_order_operations_compiled_equal_eager(compiled_algorithm, eager_algorithm) -> None:
    for spec, shapes in ((ALL_OPS, [(12, 6, 1)]), (BUDGET, [(8, 10, 0), (12, 6, 1)])):
        comp, eager = compiled_algorithm(spec), eager_algorithm(spec)
        for B, T, seed in shapes:
            b = _batch(B, T, seed)
            b = {k: v.float() for k, v in b.items()}
            b["mask"][2] = 0  # an empty row
            adv = torch.randn(B, T, generator=torch.Generator().manual_seed(seed)) * b["mask"]
            lc, gc = _loss_and_grad(comp, b["logp"], b["old"], b["ref"], adv, b["mask"], 4)
            le, ge = _loss_and_grad(eager, b["logp"], b["old"], b["ref"], adv, b["mask"], 4)
            torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)
            if spec == BUDGET:
                lp = b["logp"].double().clone().requires_grad_(True)
                ref = budget_loss_ref(lp, b["old"].double(), adv.double(), b["mask"].double())
                torch.testing.assert_close(lc.double(), ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the language around them

def test_explain_code_shows_order_operations_one_line_each() -> None:
    fn = rldsl.compile(rldsl.load(GFPO), compile=False)
    src = fn.advantages_source
    line = next(ln for ln in src.splitlines() if "group_topk_mask" in ln)
    assert line.strip() == ("bl_1 = fx.group_topk_mask(-bl_L, 2.0, bl_rows, group_size)"
                            "  # keep = group_topk_mask(-L, k)  [B]")
    budget = rldsl.compile(rldsl.load(BUDGET), compile=False).loss_source
    assert "fx.batch_cumsum(tr_2, mask)  # c = batch_cumsum(s)  [B, T]" in budget


def test_order_operations_read_groups_and_shapes_as_declared() -> None:
    algo = rldsl.load(GFPO)
    assert algo["baseline"].formula.uses_groups
    assert "group_size" in algo["baseline"].spec.facts.needs
    budget = rldsl.load(BUDGET)
    assert "group_size" not in budget["trust_region"].spec.facts.needs
    assert budget["trust_region"].formula.typed["s"].rank == 2
    assert budget["trust_region"].formula.typed["bound"].rank == 0


def test_unscoped_order_names_say_which_scoped_ones_exist() -> None:
    for name in ("sort", "rank", "cumsum", "topk_mask", "argsort"):
        text = f"algorithm o extends grpo\n  define f\n    keep = {name}(L) > 0\n  end\n  filter f\n"
        with pytest.raises(rldsl.SpecError, match="order operations are masked") as e:
            rldsl.loads(text, filename="o.rl")
        assert "o.rl:3:12" in str(e.value)


def test_loss_formulas_reading_the_batch_are_named_for_the_runtime() -> None:
    """In loss() a batch_* function reads the rows of that call: the slots where that matters."""
    from rldsl.formula import hooks

    assert hooks.batch_wide_loss(rldsl.load(BUDGET).slots) == ["trust_region"]
    assert hooks.batch_wide_loss(rldsl.load(GFPO).slots) == []  # the advantage stage sees every row
    assert rldsl.load(GFPO)["baseline"].formula.batch_wide is False
    b = _batch(8, 9, 3)
    adv = torch.randn(8, 9, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * b["mask"]
    fn = rldsl.compile(rldsl.load(BUDGET), compile=False)
    whole, _ = _loss_and_grad(fn, b["logp"], b["old"], b["ref"], adv, b["mask"], 4)
    torch.testing.assert_close(whole, budget_loss_ref(b["logp"], b["old"], adv, b["mask"]), rtol=1e-6, atol=1e-6)
    # two calls on halves compute two bounds (each half's own sorted tokens): not the batch's
    total = fn.denominator(b["mask"][:4], 4) + fn.denominator(b["mask"][4:], 4)
    halves = sum(fn.loss(b["logp"][s], b["old"][s], adv[s], b["mask"][s], group_size=4, denominator=total).loss
                 for s in (slice(0, 4), slice(4, 8)))
    ref_halves = sum(budget_loss_ref(b["logp"][s], b["old"][s], adv[s], b["mask"][s]) * b["mask"][s].sum()
                     for s in (slice(0, 4), slice(4, 8))) / b["mask"].sum()
    torch.testing.assert_close(halves, ref_halves, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", [GFPO, QUANTILE_OF_G], ids=lambda s: Path(s).stem)
def test_advantage_stage_order_statistics_are_the_same_with_1_and_4_micro_batches(spec: str) -> None:
    """Computed once over the whole batch in estimate(), then the loss over 4 micro-batches with
    the summed denominator: the same loss and gradient as one call on the whole batch."""
    fn = rldsl.compile(rldsl.load(spec), compile=False)
    b = _batch(16, 7, seed=5, lengths=TIED)
    est = fn.estimate(b["r"], 4, b["mask"])
    adv, mask = est.advantages.double(), est.mask.double()
    whole, gw = _loss_and_grad(fn, b["logp"], b["old"], b["ref"], adv, mask, 4)
    parts = [slice(i, i + 4) for i in range(0, 16, 4)]
    total = sum(fn.denominator(mask[s], 4) for s in parts)
    torch.testing.assert_close(total, fn.denominator(mask, 4))
    lp = b["logp"].clone().requires_grad_(True)
    split = sum(fn.loss(lp[s], b["old"][s], adv[s], mask[s], ref_logprobs=b["ref"][s], group_size=4,
                        denominator=total).loss for s in parts)
    (gs,) = torch.autograd.grad(split, lp)
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gs, gw, rtol=1e-12, atol=1e-12)
