"""What the docs, `rldsl check`, `rldsl explain` and the checker's help tell a user agrees with
what the code does (issue 60): the default ratio's clamp, every keyword of ``loss()``, the
advantage without a baseline, the list of functions. Each against a hand-computed reference."""
from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import rldsl
from rldsl import SpecError, compiled, explain, lint, registry
from rldsl.cli import app
from rldsl.formula import lang

ROOT = Path(__file__).resolve().parents[2]
GATE = "algorithm raw extends grpo\n  define gate\n    w = rho\n  end\n  trust_region  gate\n  kl  none\n"


def test_the_rho_row_states_the_default_ratio_clamp() -> None:
    ratio = registry.SLOTS["ratio"].default
    clamp = registry.get("ratio", ratio).params["clamp"].default
    row = next(ln for ln in (ROOT / "docs" / "formulas.md").read_text(encoding="utf-8").splitlines()
               if ln.startswith("| `rho` |"))
    c = f"{clamp:g}"
    assert f"ratio {ratio}(clamp={c})" in row and f"clamp(logp - old_logp, -{c}, {c})" in row


def test_rho_under_the_default_ratio_is_exp_of_the_clamped_log_ratio() -> None:
    """One token, A = 1, log-ratio 30: loss = -A w = -rho = -exp(20) (the docs' rule), not -exp(30)."""
    fn = rldsl.compile(rldsl.loads(GATE))
    old = torch.tensor([[-31.0]])
    new = torch.tensor([[-1.0]], requires_grad=True)
    out = fn.loss(new, old, torch.ones(1, 1), torch.ones(1, 1))
    assert math.isclose(out.loss.item(), -math.exp(20.0), rel_tol=1e-6)
    below = fn.loss(torch.tensor([[-1.0]]), torch.tensor([[-6.0]]), torch.ones(1, 1), torch.ones(1, 1))
    assert math.isclose(below.loss.item(), -math.exp(5.0), rel_tol=1e-6)  # inside the clamp: exact


def test_check_notes_the_clamp_where_a_formula_reads_rho(tmp_path: Path) -> None:
    f = tmp_path / "raw.rl"
    f.write_text(GATE, encoding="utf-8")
    r = CliRunner().invoke(app, ["check", "--strict", str(f)])
    assert r.exit_code == 0, r.output  # a note, not a warning
    assert f"{f}:5:17: note: trust_region gate reads rho" in r.output
    assert "exp(clamp(logp - old_logp, -20.0, 20.0))" in r.output and "exp(logp - old_logp)" in r.output
    # no note without a clamp, nor for a formula that does not read rho, nor for the library
    unclamped = rldsl.loads(GATE + "  ratio  geo_mean\n")
    assert lint.notes(unclamped) == []
    own = GATE.replace("w = rho", "w = exp(logp - old_logp)")
    assert lint.notes(rldsl.loads(own)) == []
    for name in rldsl.library():
        assert lint.notes(rldsl.load(name)) == [], name


def test_the_api_doc_names_every_keyword_loss_reads() -> None:
    doc = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    block = doc[doc.index("out = fn.loss("):]
    block = block[:block.index("```")]
    params = [p for p in inspect.signature(compiled.CompiledAlgorithm.loss).parameters.values()
              if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not inspect.Parameter.empty]
    assert {"sequence_rewards", "old_entropy", "router_aux"} <= {p.name for p in params}
    missing = [p.name for p in params if not re.search(rf"\b{p.name}=", block)]
    assert missing == []


NO_BASELINE = "algorithm nb extends grpo\n  baseline  none\n"


def test_explain_shows_no_baseline_term_when_there_is_none() -> None:
    algo = rldsl.loads(NO_BASELINE)
    text = "\n".join(line for entry in explain.explain_lines(algo) for line, _ in entry)
    assert "b_i" not in text
    assert "normalizer:   A_i = r_i / (std_{j in g(i)} r_j + 1e-06)" in text
    row = next(r for r in explain.slot_rows(algo) if r["slot"] == "normalizer")
    assert row["formula"] == "A_i = r_i / (std_{j in g(i)} r_j + 1e-06)"
    # with a baseline the term stays
    grpo = "\n".join(line for entry in explain.explain_lines(rldsl.load("grpo")) for line, _ in entry)
    assert "A_i = (r_i - b_i) / (std_{j in g(i)} r_j + 1e-06)" in grpo


def test_what_explain_shows_without_a_baseline_is_what_the_code_computes() -> None:
    fn = rldsl.compile(rldsl.loads(NO_BASELINE))
    r = torch.tensor([1.0, 3.0, 2.0, 6.0])
    adv = fn.estimate(r, 2, torch.ones(4, 2)).advantages[:, 0]
    std = [math.sqrt(2.0), math.sqrt(2.0), math.sqrt(8.0), math.sqrt(8.0)]  # unbiased, per group of 2
    want = torch.tensor([ri / (s + 1e-6) for ri, s in zip(r.tolist(), std)])
    torch.testing.assert_close(adv, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("path", sorted((ROOT / "algorithms").rglob("*.rl")), ids=lambda p: p.stem)
def test_explain_runs_on_every_shipped_spec(path: Path) -> None:
    """An entropy formula (no `coef`) made `explain` fail with KeyError: 'coef'."""
    algo = rldsl.load(path)
    text = "\n".join(line for entry in explain.explain_lines(algo) for line, _ in entry)
    if algo.uses_entropy and algo["entropy"].formula is not None:
        assert "+ term_it" in text


def test_the_unknown_function_help_lists_every_function() -> None:
    spec = "algorithm f\n  define g\n    w = foo(rho)\n  end\n  trust_region  g\n"
    with pytest.raises(SpecError) as e:
        rldsl.loads(spec)
    hint = e.value.hint or ""
    for name, f in lang.FUNCTIONS.items():
        if f.scope:
            family = hint[hint.index("seq_/group_/batch_ +", hint.index(
                "reductions" if f.kind == "reduce" else "order operations")):]
            assert re.search(rf"\b{f.scope}_[/ ]", hint) and re.search(rf"\b{name[len(f.scope) + 1:]}\b", family), name
        else:
            assert re.search(rf"\b{name}\b", hint), name
    assert "first_of" in hint and "bisect" in hint
