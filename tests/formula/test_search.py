"""Bounded searches of the formula language (issue 47 item 2): ``x = bisect(lo, hi, steps, cond)``
and ``x = first_of([c1, ...], cond)`` (``a, b = first_of([(a1, b1), ...], cond)`` for pairs).
Hand-computed values; properties (hypothesis) against a plain-Python search; the two methods of
the finding (clip bounds from candidate pairs, a bisected bound) against hand-written torch
references, value and gradient to 1e-6; the bisection decided exactly at a boundary, bit-exact
with the reference's arithmetic, eager and compiled; the checks, explain and the diff."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rldsl
from rldsl import explain
from rldsl.formula import hooks
from rldsl.formula import masked as fx

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "tests" / "specs" / "formula"
PAIRS = str(SPECS / "search_clip_pairs.rl")
BISECT = str(SPECS / "search_bisect_bound.rl")
CANDIDATES = [(0.05, 0.08), (0.1, 0.15), (0.2, 0.28), (0.3, 0.4)]  # as search_clip_pairs.rl

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
needs_compile = pytest.mark.compile  # compiled where RLDSL_COMPILE allows it, else skipped (tests/conftest.py)


# ---------------------------------------------------------------- hand-computed values

def test_bisect_by_hand() -> None:
    like = torch.zeros(2, 3, dtype=torch.float64)
    calls = []

    def cond(x):  # noqa: ANN001, ANN202 - true from 0.3 on
        calls.append(float(x))
        return x >= 0.3

    # [0, 1]: 0.5 holds -> [0, 0.5]; 0.25 fails -> [0.25, 0.5]; 0.375 holds -> [0.25, 0.375]
    assert float(fx.bisect(0.0, 1.0, 3, cond, like)) == 0.375
    assert calls == [0.5, 0.25, 0.375]  # exactly `steps` conditions, the midpoints (a + b) / 2
    assert float(fx.bisect(0.0, 1.0, 3, lambda x: x > 5.0, like)) == 1.0  # holds nowhere: hi
    assert float(fx.bisect(0.0, 1.0, 3, lambda x: x > -5.0, like)) == 0.125  # everywhere: lo + 1/2^3
    lo = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
    assert not fx.bisect(lo, 1.0, 2, cond, like).requires_grad  # a search decides: no gradient


def test_first_of_by_hand() -> None:
    like = torch.zeros(3)
    calls = []

    def cond(c):  # noqa: ANN001, ANN202
        calls.append(float(c))
        return c < 2.5

    assert float(fx.first_of((3.0, 2.0, 1.0), cond, like)) == 2.0
    assert calls == [3.0, 2.0]  # every candidate but the last is tried: a fixed count
    assert float(fx.first_of((3.0, 4.0, 9.0), cond, like)) == 9.0  # none holds: the last
    assert float(fx.first_of((7.0,), cond, like)) == 7.0
    lo, hi = fx.first_of(((0.1, 0.2), (0.3, 0.4), (0.5, 0.6)), lambda a, b: a + b > 0.6, like)
    assert (float(lo), float(hi)) == pytest.approx((0.3, 0.4))
    assert lo.dtype == like.dtype


# ---------------------------------------------------------------- properties (hypothesis)

@settings(max_examples=80, deadline=None)
@given(st.floats(-10, 10), st.floats(0.001, 10), st.floats(0, 1), st.integers(1, 40),
       st.sampled_from([torch.float32, torch.float64]))
def test_bisect_brackets_the_threshold_of_a_monotone_condition(lo: float, width: float, at: float, steps: int,
                                                               dtype: torch.dtype) -> None:
    like = torch.zeros(1, dtype=dtype)
    lo_t, hi_t = torch.tensor(lo, dtype=dtype), torch.tensor(lo + width, dtype=dtype)
    t = lo_t + (hi_t - lo_t) * at  # the threshold, inside [lo, hi]
    b = fx.bisect(lo_t, hi_t, steps, lambda x: x >= t, like)
    assert b.dtype == dtype
    assert b >= t  # b is hi or a midpoint where the condition held
    # ... and within one final bracket of it (the midpoints are rounded in the dtype)
    slack = (hi_t - lo_t) / 2 ** steps + 4 * torch.finfo(dtype).eps * max(abs(lo), abs(lo + width), 1.0)
    assert b - t <= slack
    # the same arithmetic, written out: bit-exact
    a, bb = lo_t, hi_t
    for _ in range(steps):
        m = (a + bb) / 2
        a, bb = (a, m) if m >= t else (m, bb)
    assert torch.equal(b, bb)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5), st.booleans()), min_size=1, max_size=8))
def test_first_of_is_the_first_candidate_that_holds(cands: list[tuple[float, float, bool]]) -> None:
    like = torch.zeros(1, dtype=torch.float64)
    holds = {(a, b): ok for a, b, ok in cands}
    want = next(((a, b) for a, b, ok in cands[:-1] if holds[(a, b)]), cands[-1][:2])
    got = fx.first_of(tuple((a, b) for a, b, _ in cands),
                      lambda x, y: torch.tensor(holds[(float(x), float(y))]), like)
    assert (float(got[0]), float(got[1])) == want
    single = fx.first_of(tuple(a for a, _, _ in cands),
                         lambda x: torch.tensor(any(holds[(float(x), b)] for a, b, _ in cands if a == float(x))),
                         like)
    first_a = next((a for a, b, _ in cands[:-1] if any(holds[(a, bb)] for aa, bb, _ in cands if aa == a)),
                   cands[-1][0])
    assert float(single) == first_a


# ---------------------------------------------------------------- the two methods of the finding

def _batch(B: int, T: int, seed: int, scale: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    logp = torch.log(0.05 + 0.9 * torch.rand(B, T, generator=g, dtype=torch.float64))
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T).expand(B, T) < lens.unsqueeze(-1)).double()
    mask[1] = 0  # a row without tokens
    old = logp + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    return dict(logp=logp, old=old, adv=adv, mask=mask)


def _loss_and_grad(fn, b: dict):  # noqa: ANN001, ANN202
    lp = b["logp"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], b["adv"], b["mask"], group_size=4)
    return out.loss, torch.autograd.grad(out.loss, lp)[0]


def clip_pairs_ref(logp, old, adv, mask, frac: float = 0.2):  # noqa: ANN001, ANN201
    """By hand: try the pairs in order until the share of the batch's valid tokens outside
    [1 - low, 1 + high] is at most frac (the widest when none is); PPO clip with it; token mean."""
    rho = torch.exp(logp - old)
    r, valid = rho.detach(), mask > 0
    chosen = len(CANDIDATES) - 1
    for i, (lo, hi) in enumerate(CANDIDATES):
        clipped = ((r < 1 - lo) | (r > 1 + hi)) & valid
        if clipped.sum() / valid.sum() <= frac:
            chosen = i
            break
    lo, hi = CANDIDATES[chosen]
    pg = torch.maximum(-adv * rho, -adv * torch.clamp(rho, 1 - lo, 1 + hi))
    return (pg * mask).sum() / mask.sum(), chosen


def bisect_bound_ref(logp, old, adv, mask, frac: float = 0.25, steps: int = 30):  # noqa: ANN001, ANN201
    """By hand: bisect eps on [0, max v] for share(v > eps) <= frac, 30 halvings keeping the upper
    end; tokens above eps keep rho's value without its gradient; -A w, token mean."""
    v = (logp - old).abs().detach()
    valid = mask > 0
    a, b = torch.zeros((), dtype=v.dtype), v[valid].max()
    for _ in range(steps):
        m = (a + b) / 2
        if ((v > m) & valid).sum() / valid.sum() <= frac:
            b = m
        else:
            a = m
    rho = torch.exp(logp - old)
    w = torch.where(v <= b, rho, rho.detach())
    return (-adv * w * mask).sum() / mask.sum(), b


@pytest.mark.parametrize("seed,scale", [(0, 0.05), (1, 0.1), (2, 0.2), (3, 0.4), (4, 1.0)])
def test_clip_bounds_from_candidate_pairs_equal_a_hand_written_search(seed: int, scale: float) -> None:
    b = _batch(8, 9, seed, scale)
    fn = rldsl.compile(rldsl.load(PAIRS), compile=False)
    loss, grad = _loss_and_grad(fn, b)
    lp = b["logp"].clone().requires_grad_(True)
    ref_loss, chosen = clip_pairs_ref(lp, b["old"], b["adv"], b["mask"])
    (ref_grad,) = torch.autograd.grad(ref_loss, lp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)
    # the scales were chosen so that each pair of the list is the one found once, the widest
    # also as the fallback where none clips little enough (scale 1.0)
    assert chosen == {0.05: 0, 0.1: 1, 0.2: 2, 0.4: 3, 1.0: 3}[scale]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_bisected_bound_equals_a_hand_written_bisection(seed: int) -> None:
    b = _batch(8, 9, seed, 0.3)
    fn = rldsl.compile(rldsl.load(BISECT), compile=False)
    loss, grad = _loss_and_grad(fn, b)
    lp = b["logp"].clone().requires_grad_(True)
    ref_loss, eps = bisect_bound_ref(lp, b["old"], b["adv"], b["mask"])
    (ref_grad,) = torch.autograd.grad(ref_loss, lp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)
    cut = (grad == 0) & (b["mask"] > 0) & (b["adv"] != 0)
    share = cut.sum() / (b["mask"] > 0).sum()
    assert 0 < share <= 0.25, "the bound stops the gradient of at most frac of the tokens"


# the value a bisection finds, read through a trust region that returns it: w = eps
EPS_ONLY = """algorithm eps_only extends grpo
  define found
    frac = 0.25
    v = sg(abs(logp - old_logp))
    eps = bisect(0, batch_max(v), 30, batch_mean(where(v > eps, 1, 0)) <= frac)
    w = eps
  end
  trust_region  found
  kl            none
"""


def _eps(fn, v: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """The bisected eps for per-token divergences v (logp 0, old_logp -v: v exactly)."""
    zero, mask = torch.zeros_like(v), torch.ones_like(v)
    return fn(zero, zero, zero, zero, -v, zero, zero, mask, 4)["w"][0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_bisection_decided_at_a_boundary_is_exact_and_deterministic(dtype: torch.dtype) -> None:
    """The first midpoint is exactly a token's value and the share there exactly frac: v > 0.5
    leaves 1 token of 4 (0.25 <= 0.25 holds), v > m for any m < 0.5 leaves 3. The bound found is
    0.5 itself, bit for bit, in float32 and float64, every time."""
    fn = hooks.function(rldsl.loads(EPS_ONLY, filename="eps.rl")["trust_region"])
    v = torch.tensor([[1.0, 0.5], [0.5, 0.25]], dtype=dtype)
    found = {float(_eps(fn, v)) for _ in range(3)}
    assert found == {0.5}
    # ... and where the midpoints round: hi = 0.3 is not a float; the midpoints are computed in
    # the stage's dtype, as a torch loop does, so the bound equals the reference's bit for bit
    v2 = torch.tensor([[0.3, 0.1], [0.2, 0.05]], dtype=dtype)
    _, want = bisect_bound_ref(torch.zeros_like(v2), -v2, torch.zeros_like(v2), torch.ones_like(v2))
    assert torch.equal(_eps(fn, v2), want)


@pytest.mark.slow  # torch.compile of the spec: tens of seconds on a busy 2-core machine
@needs_compile
def test_searches_compiled_equal_eager() -> None:
    """torch.compile unrolls the searches' loops over constants: the same losses and gradients,
    and the same bound at the boundary case (float32). (The bisection runs 8 steps here, not the
    spec's 30: the same code, a shorter compile.)"""
    texts = [Path(PAIRS).read_text(), Path(BISECT).read_text().replace(", 30,", ", 8,")]
    for text in texts:
        algo = rldsl.loads(text, filename="search.rl")
        comp, eager = rldsl.compile(algo, compile=True), rldsl.compile(algo, compile=False)
        for seed, scale in ((0, 0.1), (3, 0.4)):
            b = {k: v.float() for k, v in _batch(8, 6, seed, scale).items()}
            lc, gc = _loss_and_grad(comp, b)
            le, ge = _loss_and_grad(eager, b)
            torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)
    # the boundary case in a batch of the same shape: 4 valid tokens 1.0, 0.5, 0.5, 0.25 (padding
    # holds larger values); eps = 0.5 exactly, so the token at 1.0 alone loses its gradient
    v = torch.full((8, 6), 9.0)
    mask = torch.zeros(8, 6)
    for (i, j), x in zip([(0, 0), (0, 1), (3, 0), (5, 2)], [1.0, 0.5, 0.5, 0.25]):
        v[i, j], mask[i, j] = x, 1.0
    for fn in (comp, eager):
        lp = torch.zeros(8, 6, requires_grad=True)
        (g,) = torch.autograd.grad(fn.loss(lp, -v, torch.ones(8, 6) * mask, mask, group_size=4).loss, lp)
        assert ((g == 0) & (mask > 0)).nonzero().tolist() == [[0, 0]]


# ---------------------------------------------------------------- the language around them

def test_explain_shows_a_search_as_one_line_and_code_as_one_call() -> None:
    algo = rldsl.load(PAIRS)
    text = hooks.text(algo["trust_region"])
    assert "\n" not in text
    assert text == ("w = where(A > 0, min(rho, 1 + high), max(rho, 1 - low)),  with low, high = "
                    "first_of([(0.05, 0.08), (0.1, 0.15), (0.2, 0.28), (0.3, 0.4)], batch_mean(where("
                    "rho < 1 - low, 1, where(rho > 1 + high, 1, 0))) <= 0.2)")
    src = rldsl.compile(algo, compile=False).loss_source
    line = next(ln.strip() for ln in src.splitlines() if "fx.first_of" in ln)
    assert line.startswith("tr_1, tr_2 = fx.first_of(((0.05, 0.08), (0.1, 0.15), (0.2, 0.28), (0.3, 0.4)), "
                           "lambda tr_1, tr_2: fx.batch_mean(")
    assert line.endswith("<= 0.2, mask)  # low, high = first_of([(0.05, 0.08), (0.1, 0.15), (0.2, 0.28), "
                         "(0.3, 0.4)], batch_mean(where(rho < 1 - low, 1, where(rho > 1 + high, 1, 0))) <= frac)  []")
    src = rldsl.compile(rldsl.load(BISECT), compile=False).loss_source
    assert ("tr_2 = fx.bisect(0.0, fx.batch_max(tr_1, mask), 30, lambda tr_2: fx.batch_mean(torch.where("
            "tr_1 > tr_2, fx.scalar(1.0, mask), 0.0), mask) <= 0.25, mask)  # eps = bisect(0, batch_max(v), "
            "30, batch_mean(where(v > eps, 1, 0)) <= frac)  []") in src


def test_diff_compares_a_search_like_any_binding() -> None:
    a = rldsl.load(PAIRS)
    b = rldsl.loads(Path(PAIRS).read_text().replace("(0.3, 0.4)]", "(0.3, 0.45)]"), filename="b.rl")
    s = next(x for x in explain.diff(a, b)["slots"] if x["slot"] == "trust_region")
    assert s["status"] == "formula differs"
    assert [x["binding"] for x in s["bindings"]] == ["low, high"]
    assert s["bindings"][0]["b"].startswith("first_of([(0.05, 0.08), (0.1, 0.15), (0.2, 0.28), (0.3, 0.45)]")
    c = rldsl.loads(Path(BISECT).read_text().replace("frac = 0.25", "frac = 0.3"), filename="c.rl")
    s = next(x for x in explain.diff(rldsl.load(BISECT), c)["slots"] if x["slot"] == "trust_region")
    assert s["status"] == "params differ" and s["params"] == [{"param": "frac", "a": 0.25, "b": 0.3}]
    d = rldsl.loads(Path(BISECT).read_text().replace(", 30,", ", 40,"), filename="d.rl")
    s = next(x for x in explain.diff(rldsl.load(BISECT), d)["slots"] if x["slot"] == "trust_region")
    assert s["bindings"] == [{"binding": "eps", "a": "bisect(0, batch_max(v), 30, batch_mean(where(v > eps, 1, 0)) "
                              "<= frac)", "b": "bisect(0, batch_max(v), 40, batch_mean(where(v > eps, 1, 0)) <= frac)"}]


def test_searches_read_the_batch_and_the_inputs_of_their_condition() -> None:
    f = rldsl.load(PAIRS)["trust_region"].formula
    assert f.batch_wide and "rho" in f.reads and "A" in f.reads
    assert f.typed["low"].rank == 0 and f.typed["high"].index == 1
    assert hooks.batch_wide_loss(rldsl.load(BISECT).slots) == ["trust_region"]


def _err(body: str) -> rldsl.SpecError:
    text = f"algorithm s extends grpo\n  define f\n{body}  end\n  trust_region  f\n"
    with pytest.raises(rldsl.SpecError) as e:
        rldsl.loads(text, filename="s.rl")
    return e.value


@pytest.mark.parametrize("body,where,message", [
    ("    t = bisect(0, 1, 0.5 < t)\n    w = rho * t\n", "s.rl:3:9",
     "bisect takes 4 arguments (lo, hi, a constant number of steps and a condition), got 3"),
    ("    t = bisect(0, 1, seq_max(L), batch_mean(where(rho > t, 1, 0)) <= 0.1)\n    w = rho * t\n", "s.rl:3:22",
     "bisect's step count must be one number [], got [B]"),
    ("    t = bisect(0, 1, B, batch_mean(where(rho > t, 1, 0)) <= 0.1)\n    w = rho * t\n", "s.rl:3:22",
     "bisect's step count must be a constant: a search runs a fixed number of steps"),
    ("    t = bisect(0, 1, 100, batch_mean(where(rho > t, 1, 0)) <= 0.1)\n    w = rho * t\n", "s.rl:3:22",
     "bisect's step count must be a whole number from 1 to 64, got 100.0"),
    ("    t = bisect(1, 0, 10, batch_mean(where(rho > t, 1, 0)) <= 0.1)\n    w = rho * t\n", "s.rl:3:9",
     "bisect's bracket is empty: lo 1.0 is above hi 0.0"),
    ("    t = bisect(0, 1, 10, rho > t)\n    w = rho * t\n", "s.rl:3:26",
     "bisect's condition must be one true/false [], got [B, T]"),
    ("    t = bisect(0, 1, 10, batch_mean(rho) > 1)\n    w = rho * t\n", "s.rl:3:26",
     "bisect's condition does not read 't'"),
    ("    w = rho * bisect(0, 1, 10, batch_mean(rho) > 1)\n", "s.rl:3:15",
     "bisect(...) must be the whole right side of a binding"),
    ("    e = first_of(0.2, batch_mean(rho) > e)\n    w = rho * e\n", "s.rl:3:18",
     "first_of's first argument must be the list of candidates [c1, c2, ...]"),
    ("    e = first_of([0.2, (0.1, 0.3)], batch_mean(rho) > e)\n    w = rho * e\n", "s.rl:3:24",
     "a tuple candidate binds several names"),
    ("    lo, hi = first_of([(0.2, 0.3), 0.1], batch_mean(rho) > lo + hi)\n    w = rho * lo * hi\n", "s.rl:3:36",
     "each candidate is a tuple of 2 numbers (lo, hi)"),
    ("    lo, hi = rho\n    w = lo\n", "s.rl:3:14", "only a search over candidate tuples binds several names (lo, hi)"),
    ("    w = rho * max([1, 2], 0)\n", "s.rl:3:19", "a list [...] is only the candidates of a search"),
])
def test_misused_searches_are_errors_at_their_place(body: str, where: str, message: str) -> None:
    e = _err(body)
    assert e.message == message
    assert where in str(e)
