"""`lgamma` (float64 inside), bindings continued over lines, and functions written in a spec
(`define f(a, b) = ...`), each against references computed by hand or with Python's math."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import rldsl
from rldsl import SpecError, SpecErrors, codegen
from rldsl.cli import app

G = 32


def _rewards(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(4 * G, generator=g) < torch.tensor([0.1, 0.3, 0.6, 0.9]).repeat_interleave(G)).float()


PASS_AT_K = """algorithm passk extends grpo
  define passk_adv
    k = 4
    c = group_sum(r)
    fail = where(G - c >= k,                             # C(G - c, k) / C(G, k); 0 when G - c < k
                 exp(lgamma(G - c + 1) - lgamma(G - c - k + 1) -
                     lgamma(G + 1) + lgamma(G - k + 1)),
                 0)
    A = 1 - fail - r
  end
  baseline  passk_adv
  normalizer  none
"""


def _pass_at_k_reference(r: torch.Tensor, k: int) -> torch.Tensor:
    out = []
    for i in range(len(r)):
        c = float(r[(i // G) * G:(i // G + 1) * G].sum())
        fail = 0.0 if G - c < k else math.exp(math.lgamma(G - c + 1) - math.lgamma(G - c - k + 1)
                                              - math.lgamma(G + 1) + math.lgamma(G - k + 1))
        out.append(1 - fail - float(r[i]))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("k", [2, 4, 7])
def test_a_binomial_ratio_through_lgamma_is_exact_to_1e_7(k: int) -> None:
    fn = rldsl.compile(rldsl.loads(PASS_AT_K.replace("k = 4", f"k = {k}")))
    r = _rewards()
    adv = fn.estimate(r, G, torch.ones(4 * G, 3)).advantages
    assert adv.dtype == torch.float32  # back to the stage's dtype
    err = (adv[:, 0].double() - _pass_at_k_reference(r, k)).abs().max().item()
    assert err <= 1e-7, err
    # the same sum in float32 is not: what computing inside in float64 buys
    cs = [c for c in range(G - k + 1)]
    c = torch.tensor([float(c) for c in cs])
    f32 = torch.exp(torch.lgamma(G - c + 1) - torch.lgamma(G - c - k + 1) - torch.lgamma(torch.tensor(G + 1.0))
                    + torch.lgamma(torch.tensor(G - k + 1.0)))
    f64 = [math.exp(math.lgamma(G - c + 1) - math.lgamma(G - c - k + 1) - math.lgamma(G + 1)
                    + math.lgamma(G - k + 1)) for c in cs]
    assert max(abs(a - b) for a, b in zip(f32.tolist(), f64)) > 1e-7


BETA = """algorithm beta extends grpo
  define logbeta(a, b) = lgamma(a) + lgamma(b) -
                         lgamma(a + b)
  define mean_beta(a, b) = exp(logbeta(a + 1, b) - logbeta(a, b))   # = a / (a + b)
  define posterior
    prior = 40
    s = group_sum(r)
    b = mean_beta(prior * (s + 1),
                  prior * (G - s + 1))
  end
  baseline  posterior
  normalizer  none
"""


def test_a_beta_normalised_baseline_from_spec_functions_is_exact_to_1e_7() -> None:
    """B(a + 1, b) / B(a, b) = a / (a + b): a log-Beta difference of lgammas near 1e3, exact."""
    fn = rldsl.compile(rldsl.loads(BETA))
    r = _rewards(1)
    adv = fn.estimate(r, G, torch.ones(4 * G, 2)).advantages[:, 0]
    want = []
    for i in range(len(r)):
        s = float(r[(i // G) * G:(i // G + 1) * G].sum())
        a, b = 40 * (s + 1), 40 * (G - s + 1)
        want.append(float(r[i]) - a / (a + b))
    err = (adv.double() - torch.tensor(want, dtype=torch.float64)).abs().max().item()
    assert err <= 1e-7, err


def test_the_generated_code_is_the_expansion_and_computes_lgamma_in_float64() -> None:
    source = codegen.generate(rldsl.loads(BETA)).source
    line = next(ln for ln in source.splitlines() if ln.lstrip().startswith("adv = fx.spread(r - "))
    assert line.count("torch.lgamma(") == 6 and ".double()" in line and ".to(mask.dtype)" in line
    assert "logbeta" not in line.split("#")[0] and "mean_beta" not in line.split("#")[0]
    assert "torch.lgamma" not in codegen.generate(rldsl.load("grpo")).source


def test_explain_code_shows_the_expanded_formula(tmp_path: Path) -> None:
    f = tmp_path / "beta.rl"
    f.write_text(BETA, encoding="utf-8")
    out = CliRunner().invoke(app, ["explain", "--code", str(f)])
    assert out.exit_code == 0, out.output
    assert "torch.lgamma(" in out.output


def test_lgamma_of_constants_folds_and_a_pole_is_an_error() -> None:
    spec = "algorithm f\n  define g\n    w = rho * lgamma(5)\n  end\n  trust_region  g\n"
    src = codegen.generate(rldsl.loads(spec)).source
    assert repr(math.lgamma(5)) in src  # log 4! folded at check time
    with pytest.raises(SpecError) as e:
        rldsl.loads(spec.replace("lgamma(5)", "lgamma(0)"))
    assert "lgamma(0)" in e.value.render()


def test_a_spec_without_lgamma_generates_the_same_code_as_before() -> None:
    """No float64 cast or `.to(mask.dtype)` is added where no lgamma is used."""
    for name in rldsl.library():
        assert ".double()" not in codegen.generate(rldsl.load(name)).source, name


# ---------------------------------------------------------------------------------------
# Bindings continued over lines


ONE_LINE = "algorithm c extends grpo\n  define gate\n    w = clamp(rho, 0.8, 1.2) * where(A > 0, 1, 0.5)\n  end\n  trust_region  gate\n"
CONTINUED = """algorithm c extends grpo
  define gate
    w = clamp(rho,      # the ratio
              0.8,
              1.2) *
        where(A > 0, 1,
              0.5)
  end
  trust_region  gate
"""


def test_a_continued_binding_compiles_to_the_one_line_binding() -> None:
    one = codegen.generate(rldsl.loads(ONE_LINE)).source
    many = codegen.generate(rldsl.loads(CONTINUED)).source
    body = lambda s: [ln.split("#")[0] for ln in s.splitlines() if "w = " in ln]  # noqa: E731
    assert body(one) == body(many)


def test_errors_in_a_continued_binding_point_at_the_line_as_written() -> None:
    with pytest.raises(SpecError) as e:
        rldsl.loads(CONTINUED.replace("0.5)", "foo)"), "c.rl")
    assert (e.value.line, e.value.column) == (7, 15) and e.value.message == "unknown name 'foo'"
    assert "   7 |               foo)" in e.value.render()
    with pytest.raises(SpecError) as e:
        rldsl.loads(CONTINUED.replace("1.2) *", "1.2) * *"), "c.rl")
    assert (e.value.line, e.value.column) == (5, 22)
    with pytest.raises(SpecError) as e:  # still open at `end`: the line is incomplete
        rldsl.loads(CONTINUED.replace("              0.5)", "              0.5"), "c.rl")
    assert e.value.line == 7 and "close the parenthesis" in (e.value.hint or "")


def test_lines_outside_formulas_do_not_continue() -> None:
    with pytest.raises(SpecError) as e:
        rldsl.loads("algorithm x\n  trust_region  clip(low=0.2,\n    high=0.3)\n", "x.rl")
    assert e.value.line == 2 and "on the line where it starts" in (e.value.hint or "")


# ---------------------------------------------------------------------------------------
# Functions: what is refused, located


def _errors(text: str) -> list[SpecError]:
    with pytest.raises(SpecError) as e:
        rldsl.loads(text, "f.rl")
    return e.value.errors if isinstance(e.value, SpecErrors) else [e.value]


@pytest.mark.parametrize("change, message, line", [
    ("lgamma(a + b)", "function 'logbeta' reads 'rho', which is not one of its parameters (a, b)", 3),
    ("mean_beta(prior * (s + 1),", "mean_beta takes 2 arguments, got 3", 8),
    ("define logbeta(a, b)", "function 'exp' has the name of a built-in function", 2),
    ("exp(logbeta(a + 1, b)", "function 'mean_beta' calls itself: mean_beta -> mean_beta", 4),
])
def test_bad_functions_are_located(change: str, message: str, line: int) -> None:
    new = {"lgamma(a + b)": "lgamma(a + rho)",
           "mean_beta(prior * (s + 1),": "mean_beta(prior, prior * (s + 1),",
           "define logbeta(a, b)": "define exp(a, b)",
           "exp(logbeta(a + 1, b)": "exp(mean_beta(a + 1, b)"}[change]
    errs = _errors(BETA.replace(change, new))
    hit = [e for e in errs if e.message == message]
    assert hit and hit[0].line == line and hit[0].column >= 1, [e.render() for e in errs]


def test_an_uncalled_function_is_an_error() -> None:
    errs = _errors(BETA.replace("  define posterior", "  define twice(x) = 2 * x\n  define posterior"))
    assert [e.message for e in errs] == ["function 'twice' is not called by any formula"]


def test_mutual_recursion_is_refused_not_expanded_forever() -> None:
    text = ("algorithm m extends grpo\n  define f(x) = g(x) + 1\n  define g(x) = f(x) * 2\n"
            "  define gate\n    w = rho * f(1)\n  end\n  trust_region  gate\n")
    messages = {e.message for e in _errors(text)}
    assert "function 'f' calls itself: f -> g -> f" in messages


def test_an_expansion_past_the_limits_is_refused_at_the_call() -> None:
    """Each level doubles the terms: 2^20 terms if expanded; refused at the binding's first call."""
    fns = "".join(f"  define f{i}(x) = f{i - 1}(x) + f{i - 1}(x)\n" for i in range(1, 21))
    text = ("algorithm m extends grpo\n  define f0(x) = x * 2\n" + fns +
            "  define gate\n    w = rho * f20(rho)\n  end\n  trust_region  gate\n")
    errs = _errors(text)
    assert [e.message for e in errs] == [
        "the calls of this binding expand to a formula larger than the limit (200 levels, 20000 terms)"]
    assert (errs[0].line, errs[0].column) == (24, 15)


def test_a_slot_line_after_a_function_gets_the_slot_line_hint() -> None:
    """A one-line `define f(x) = ...` opens no block: a later slot line's error is not a formula's."""
    text = ("algorithm x extends grpo\n  define g\n    w = rho * sq(2)\n  end\n  define sq(x) = x * x\n"
            "  trust_region  g\n  kl  k3(beta=0.1\n")
    errs = _errors(text)
    assert errs[0].line == 7 and errs[0].hint == "close the argument list with ')' on the same line"


def test_lgamma_of_a_reduction_is_float64_too() -> None:
    """A reduction or order operation written inside lgamma's argument (not through a binding)
    is computed in float64 like every other read there: lgamma(1e6 + n) - lgamma(1e6 + n - 1) is
    log(1e6 + n - 1) to 1e-9, where a float32 lgamma (~1.3e7, spacing 1) would be off by ~1."""
    spec = """algorithm wide extends grpo
  define counted
    A = lgamma(group_cumsum(1) + 1000000) - lgamma(group_cumsum(1) + 999999) + 0 * r
  end
  baseline  counted
  normalizer  none
"""
    fn = rldsl.compile(rldsl.loads(spec), compile=False)
    adv = fn.estimate(torch.ones(8), 4, torch.ones(8, 2)).advantages[:, 0].double()
    want = torch.tensor([math.log(999999 + j) for j in [1, 2, 3, 4, 1, 2, 3, 4]], dtype=torch.float64)
    assert float((adv - want).abs().max()) < 1e-5  # float32's rounding of ~13.8 at the output
