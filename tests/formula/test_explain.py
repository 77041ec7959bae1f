"""`rldsl explain` with formulas: the formula shown per slot, composed into the objective,
the generated torch lines in --code, and diffs formula vs component and formula vs formula."""
from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

import rldsl
from rldsl import explain
from rldsl.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()

SAPO = """algorithm sapo extends grpo
  "The SAPO gate instead of the clip."
  define sapo_gate
    tau_pos = 1.0
    tau_neg = 1.05
    tau = where(A > 0, tau_pos, tau_neg)
    w = sigmoid(tau * (rho - 1)) * 4 / tau
  end
  trust_region  sapo_gate(tau_neg=1.1)
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / f"{name}.rl"
    p.write_text(text)
    return str(p)


def test_explain_shows_the_formula_and_composes_the_objective(tmp_path: Path) -> None:
    algo = rldsl.loads(SAPO, filename=str(tmp_path / "sapo.rl"))
    row = next(r for r in explain.slot_rows(algo) if r["slot"] == "trust_region")
    assert row["component"] == "sapo_gate" and row["params"] == {"tau_pos": 1.0, "tau_neg": 1.1}
    assert row["formula"] == "w = sigmoid(tau * (rho - 1)) * 4 / tau,  with tau = where(A > 0, 1.0, 1.1)"
    assert row["source"].startswith("formula, define sapo_gate (") and row["source"].endswith("sapo.rl:3)")
    lines = explain.objective_lines(algo)
    assert "trust region: w = sigmoid(tau * (rho - 1)) * 4 / tau,  with tau = where(A > 0, 1.0, 1.1)" in lines
    out = runner.invoke(app, ["explain", write(tmp_path, "sapo", SAPO)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "sapo_gate(tau_pos=1.0, tau_neg=1.1)" in out.output
    assert "w = sigmoid(tau * (rho - 1)) * 4 / tau" in out.output


def test_explain_code_shows_the_formula_as_torch_lines_with_shapes(tmp_path: Path) -> None:
    out = runner.invoke(app, ["explain", "--code", write(tmp_path, "sapo", SAPO)])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    i = next(k for k, ln in enumerate(lines) if "# trust_region sapo_gate  spec line 9 (formula:" in ln)
    assert lines[i].strip() == "# trust_region sapo_gate  spec line 9 (formula: tau_pos=1.0, tau_neg=1.1)"
    assert lines[i + 1].strip() == ("tr_1 = torch.where(adv > 0.0, fx.scalar(1.0, mask), 1.1)  "
                                    "# tau = where(A > 0, tau_pos, tau_neg)  [B, T]")
    assert lines[i + 2].strip() == ("w = torch.sigmoid(tr_1 * (rho - 1.0)) * 4.0 / tr_1  "
                                    "# w = sigmoid(tau * (rho - 1)) * 4 / tau  [B, T]")


def test_diff_formula_against_registry_component(tmp_path: Path) -> None:
    d = explain.diff(rldsl.load("grpo"), rldsl.loads(SAPO, filename="sapo.rl"))
    s = next(x for x in d["slots"] if x["slot"] == "trust_region")
    assert s["status"] == "component differs"
    assert s["a"] == "clip(low=0.2, high=0.2)" and s["b"] == "sapo_gate(tau_pos=1.0, tau_neg=1.1)"
    assert s["a_formula"].startswith("w = min(rho, 1+0.2) if A >= 0")
    assert s["b_formula"] == "w = sigmoid(tau * (rho - 1)) * 4 / tau,  with tau = where(A > 0, 1.0, 1.1)"
    assert s["params"] == [{"param": "low", "a": 0.2, "b": None}, {"param": "high", "a": 0.2, "b": None},
                           {"param": "tau_pos", "a": None, "b": 1.0}, {"param": "tau_neg", "a": None, "b": 1.1}]
    assert d["differences"] == 1


def test_diff_formula_against_formula_parameter_by_parameter(tmp_path: Path) -> None:
    a = rldsl.loads(SAPO, filename="a.rl")
    b = rldsl.loads(SAPO.replace("(tau_neg=1.1)", "(tau_neg=1.2, tau_pos=0.9)"), filename="b.rl")
    s = next(x for x in explain.diff(a, b)["slots"] if x["slot"] == "trust_region")
    assert s["status"] == "params differ"
    assert s["params"] == [{"param": "tau_pos", "a": 1.0, "b": 0.9}, {"param": "tau_neg", "a": 1.1, "b": 1.2}]
    c = rldsl.loads(SAPO.replace("sigmoid(tau * (rho - 1))", "sigmoid(tau * (rho - 1) * 2)"), filename="c.rl")
    s = next(x for x in explain.diff(a, c)["slots"] if x["slot"] == "trust_region")
    assert s["status"] == "formula differs"
    assert s["bindings"] == [{"binding": "w", "a": "sigmoid(tau * (rho - 1)) * 4 / tau",
                              "b": "sigmoid(tau * (rho - 1) * 2) * 4 / tau"}]
    assert "params" not in s
    assert explain.diff(a, a)["differences"] == 0


def test_cli_diff_prints_formula_rows(tmp_path: Path) -> None:
    b = write(tmp_path, "b", SAPO.replace("sigmoid(tau * (rho - 1))", "sigmoid(2 * tau * (rho - 1))"))
    out = runner.invoke(app, ["explain", write(tmp_path, "a", SAPO), b], env={"COLUMNS": "240"})
    assert out.exit_code == 0, out.output
    row = next(ln for ln in out.output.splitlines() if ln.startswith("≠ trust_region"))
    assert "sapo_gate(tau_pos=1.0, tau_neg=1.1) -> sapo_gate(tau_pos=1.0, tau_neg=1.1)" in row
    assert "w: sigmoid(tau * (rho - 1)) * 4 / tau -> sigmoid(2 * tau * (rho - 1)) * 4 / tau" in out.output
    assert "w = sigmoid(2 * tau * (rho - 1)) * 4 / tau" in out.output
    assert "1 slot(s) differ" in out.output
    out = runner.invoke(app, ["explain", "grpo", b, "--format", "json"])
    d = json.loads(out.output)
    assert next(x for x in d["slots"] if x["slot"] == "trust_region")["status"] == "component differs"


def test_explain_json_of_a_formula_spec(tmp_path: Path) -> None:
    out = runner.invoke(app, ["explain", "--format", "json", write(tmp_path, "sapo", SAPO)])
    assert out.exit_code == 0, out.output
    d = json.loads(out.output)
    row = next(r for r in d["slots"] if r["slot"] == "trust_region")
    assert row["component"] == "sapo_gate" and row["formula"].startswith("w = sigmoid")


def test_check_reports_formula_errors_with_a_caret(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad", SAPO.replace("rho - 1", "rho - one"))
    out = runner.invoke(app, ["check", bad])
    assert out.exit_code == 2  # an invalid spec is bad input
    assert f"{bad}:7:30: error: unknown name 'one'" in out.output
    assert "^~~" in out.output


def test_the_docs_hold_the_language_tables() -> None:
    from rldsl.formula import lang

    doc = (ROOT / "docs" / "formulas.md").read_text(encoding="utf-8")
    for table in (lang.slot_table(), lang.input_table(), lang.function_table(), lang.order_table()):
        assert table in doc, "docs/formulas.md is out of date: paste the table from rldsl.formula.lang"


def test_diff_of_a_multi_component_slot_with_formulas() -> None:
    base = ROOT / "tests" / "specs" / "formula" / "advantage_slots.rl"
    a = rldsl.load(str(base))
    b = rldsl.loads(base.read_text().replace("scale = 0.01", "scale = 0.02")
                    .replace("r = clamp(r, -1, 1)", "r = clamp(r, -2, 2)"), filename="b.rl")
    s = next(x for x in explain.diff(a, b)["slots"] if x["slot"] == "shaping")
    assert s["status"] == "formula differs"
    assert s["params"] == [{"param": "length_bonus.scale", "a": 0.01, "b": 0.02}]
    assert s["bindings"] == [{"binding": "clip_reward.r", "a": "clamp(r, -1, 1)", "b": "clamp(r, -2, 2)"}]
    assert next(x for x in explain.diff(a, a)["slots"] if x["slot"] == "shaping")["status"] == "same"
    c = rldsl.loads(base.read_text().replace("overlong_penalty(max_len=64, cache=8), ", ""), filename="c.rl")
    assert next(x for x in explain.diff(a, c)["slots"] if x["slot"] == "shaping")["status"] == "component differs"


def test_a_formula_spec_survives_pickling() -> None:
    """The distributed runtime ships the resolved algorithm to its actors."""
    import pickle

    algo = rldsl.load(str(ROOT / "algorithms" / "examples" / "gmpo.rl"))
    again = pickle.loads(pickle.dumps(algo))
    assert again == algo
    assert rldsl.compile(again, compile=False).source == rldsl.compile(algo, compile=False).source


def test_explain_shows_no_baseline_term_when_the_baseline_writes_the_advantage(tmp_path: Path) -> None:
    """A baseline formula binding A is the advantage: the normalizer's row has no b_i in it
    (`none` passes A on, a std divides A itself), and a b-baseline keeps its r_i - b_i."""
    spec = """algorithm wa extends grpo
  define z
    A = (r - group_mean(r)) / 2
  end
  baseline  z
  normalizer  none
"""
    rows = {r["slot"]: r["formula"] for r in explain.slot_rows(rldsl.load(write(tmp_path, "wa", spec)))}
    assert "b_i" not in rows["normalizer"] and "writes the advantage" in rows["normalizer"]
    std = spec.replace("normalizer  none", "normalizer  group_std")
    rows = {r["slot"]: r["formula"] for r in explain.slot_rows(rldsl.load(write(tmp_path, "ws", std)))}
    assert rows["normalizer"].startswith("A_i = A_it / (std_") and "b_i" not in rows["normalizer"]
    grpo = {r["slot"]: r["formula"] for r in explain.slot_rows(rldsl.load("grpo"))}
    assert "(r_i - b_i)" in grpo["normalizer"]
