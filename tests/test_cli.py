"""The language CLI: check, explain (text, json, --code, diff) and list; exit codes."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import rldsl
from rldsl import registry
from rldsl.cli import app

runner = CliRunner()
REPO = Path(__file__).parent.parent


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")  # rich wraps tables at the terminal width


def test_check_valid_and_invalid_files(tmp_path):
    bad = tmp_path / "bad.rl"
    bad.write_text("algorithm x extends grpo\n  baseline group_mena\n  trust_region clip(low=0, hi=0.3)\n")
    res = runner.invoke(app, ["check", str(REPO / "algorithms" / "grpo.rl"), str(bad)])
    assert res.exit_code == 2
    out = res.output
    assert "ok: " in out and "algorithm grpo" in out
    # every error of the file, each with file:line:col, the line, a caret and a hint
    assert f"{bad}:2:12: error: unknown baseline 'group_mena'" in out
    assert "did you mean 'group_mean'?" in out
    assert f"{bad}:3:25: error: argument 'low' of trust_region clip must be > 0" in out
    assert f"{bad}:3:28: error: unknown argument 'hi' for trust_region clip" in out
    assert "^~~~~~~~~~" in out and "Traceback" not in out


def test_check_all_library_specs_ok():
    res = runner.invoke(app, ["check", *sorted(rldsl.library())])
    assert res.exit_code == 0, res.output
    assert res.output.count("ok: ") == len(rldsl.library())


def test_usage_errors_exit_2():
    assert runner.invoke(app, ["check"]).exit_code == 2
    assert runner.invoke(app, ["explain", "grpo", "--format", "yaml"]).exit_code == 2
    assert runner.invoke(app, ["explain", "grpo", "dapo", "ppo"]).exit_code == 2
    assert runner.invoke(app, ["list", "baselin"]).exit_code == 2


def test_traceback_only_on_request(tmp_path):
    bad = tmp_path / "bad.rl"
    bad.write_text("algorithm x\n  baseline nope\n")
    res = runner.invoke(app, ["check", "--traceback", str(bad)])
    assert isinstance(res.exception, rldsl.SpecError)


def test_explain_shows_slots_formulas_and_objective():
    res = runner.invoke(app, ["explain", "dapo"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "dapo extends grpo" in out
    assert "clip(low=0.2, high=0.28)" in out
    assert "w = min(rho, 1+0.28) if A >= 0 else max(rho, 1-0.2)" in out
    assert "inherited from grpo" in out
    assert "minimised:" in out and "token_mean" in out


def test_explain_and_list_leave_out_the_parameters_a_component_ignores():
    """A supervised distill component reads no clip: explain shows clip_low / clip_high / clip_c
    only with mode=policy_gradient; list says when they are read."""
    gkd = runner.invoke(app, ["explain", "gkd"]).output
    assert "jsd(beta=0.5, temperature=1.0, mode=supervised, coef=1.0, task=false)" in gkd
    assert "clip_" not in gkd
    opd = runner.invoke(app, ["explain", "opd"]).output
    assert "reverse_kl(estimator=k1, mode=policy_gradient, coef=1.0, task=false, clip_low=0.2, clip_high=0.2, " \
           "clip_c=3.0)" in opd
    listed = " ".join(runner.invoke(app, ["list", "distill"]).output.split())
    for name in ("clip_low", "clip_high", "clip_c"):
        assert listed.count(f"{name}: float") == 3  # reverse_kl, forward_kl_topk, jsd
        assert all("read only with mode=policy_gradient" in line.split(" — ")[0]
                   for line in listed.split(f"{name}: float")[1:])


def test_explain_code_is_the_generated_source():
    res = runner.invoke(app, ["explain", "--code", "cispo"])
    assert res.exit_code == 0
    assert res.output == rldsl.compile(rldsl.load("cispo"), compile=False).source
    assert "trust_region.truncate(rho, adv, logp, old_logp, high=0.2, low=None)" in res.output


def test_explain_json():
    res = runner.invoke(app, ["explain", "maxrl", "--format", "json"])
    d = json.loads(res.output)
    assert d["name"] == "maxrl" and d["extends"] == ["grpo"]
    rows = {r["slot"]: r for r in d["slots"]}
    assert rows["normalizer"]["component"] == "success_rate"
    assert rows["normalizer"]["params"] == {"eps": 1e-06, "group_by": None}
    assert rows["rewards"]["component"] == "binary"


def test_explain_diff_slot_by_slot():
    res = runner.invoke(app, ["explain", "grpo", "dapo", "--format", "json"])
    d = json.loads(res.output)
    by = {s["slot"]: s for s in d["slots"]}
    assert by["trust_region"]["status"] == "params differ"
    assert by["trust_region"]["params"] == [{"param": "high", "a": 0.2, "b": 0.28}]
    assert by["kl"]["status"] == "component differs"
    assert by["baseline"]["status"] == "same"
    assert by["baseline"]["b_from"].startswith("inherited from grpo")
    assert d["differences"] == 5  # shaping, sampling, trust_region, kl, aggregation
    text = runner.invoke(app, ["explain", "grpo", "dapo"]).output
    assert "5 slot(s) differ" in text


def test_list_every_component():
    res = runner.invoke(app, ["list"])
    assert res.exit_code == 0
    for slot, comps in registry.REGISTRY.items():
        for name in comps:
            assert name in res.output
    for name in rldsl.library():
        assert name in res.output


def test_every_component_documents_formula_source_shapes_and_params():
    for slot, comps in registry.REGISTRY.items():
        for name, comp in comps.items():
            assert comp.formula and comp.source, f"{slot}.{name}"
            if comp.fn is not None:
                assert comp.shapes, f"{slot}.{name} has no shapes"
            for pname, p in comp.params.items():
                assert p.doc, f"{slot}.{name}.{pname} has no doc"


def test_registry_refuses_duplicates_and_undocumented():
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("baseline", "group_mean")(lambda batch: None)

    def undocumented(batch):
        return batch
    with pytest.raises(ValueError, match="formula"):
        registry.register("baseline", "tmp_undocumented")(undocumented)
    assert "tmp_undocumented" not in registry.REGISTRY["baseline"]


# ---------------------------------------------------------------------------------------
# Output is literal and does not depend on the width


def _lines(output: str) -> list[str]:
    return [ln.rstrip() for ln in output.splitlines()]


def test_list_prints_every_formula_whole_at_any_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "30")  # piped: wrapped at spaces to 100 columns, never cut or folded
    res = runner.invoke(app, ["list"])
    assert res.exit_code == 0, res.output
    # the text with the line breaks of the wrapping undone (a list of choices breaks after a '|')
    out = " ".join(re.sub(r"\|\n *", "|", res.output).split())

    def whole(text: str) -> str:
        return " ".join(text.split())
    # square brackets are text, not markup (this one printed as "keep_i = 1" before)
    assert "keep_i = 1[max_{g(i)} r != min_{g(i)} r]" in out
    for slot, comps in registry.REGISTRY.items():
        assert whole(registry.SLOTS[slot].doc) in out
        for name, comp in comps.items():
            assert comp.formula
            for line in comp.formula.splitlines():
                assert whole(line) in out, f"{slot}.{name}: {line!r}"
            for pname, p in comp.params.items():
                assert whole(f"{pname}: {p.describe()} — {p.doc}") in out, f"{slot}.{name}.{pname}"
    for name in rldsl.library():
        assert whole(rldsl.load(name).description) in out
    assert "needs truncated=" in out and "carried out by the runtime: data.pass_rate_cap = max" in out
    one = runner.invoke(app, ["list", "filter"]).output
    assert "zero_variance" in one and "group_mean" not in one and "algorithms (library)" not in one


@pytest.mark.parametrize("name", sorted(rldsl.library()))
def test_explain_prints_every_formula_whole_at_any_width(name, monkeypatch):
    monkeypatch.setenv("COLUMNS", "30")
    algo = rldsl.load(name)
    res = runner.invoke(app, ["explain", name])
    assert res.exit_code == 0, res.output
    out = _lines(res.output)
    for slot, values in algo.slots.items():
        for v in values:
            formula = v.spec.formula_with(v.params)
            for line in formula.splitlines():
                assert any(ln.strip() == line for ln in out), f"{name} {slot}: {line!r}"
            assert any(ln.startswith(f"{slot:<12}  {v}") or ln.strip().startswith(str(v)) for ln in out)
    for line in rldsl.explain.objective_lines(algo):
        assert "  " + line in out
    assert algo.description in res.output


def test_explain_diff_is_a_plain_text_diff_with_identical_slots_folded(monkeypatch):
    monkeypatch.setenv("COLUMNS", "30")
    monkeypatch.chdir(REPO)  # the header shows library paths relative to the working directory
    res = runner.invoke(app, ["explain", "grpo", "dapo"])
    assert res.exit_code == 0, res.output
    out = _lines(res.output)
    assert out[0] == "grpo (algorithms/grpo.rl)  vs  dapo (algorithms/dapo.rl)"
    assert "~ trust_region  clip(low=0.2, high=0.2) -> clip(low=0.2, high=0.28)" in out
    assert "≠ kl            k3(beta=0.04, where=loss, clamp=false, ratio_weighted=false, straight_through=false) -> none" in out
    assert any(ln.strip() == "high: 0.2 -> 0.28" for ln in out)
    grpo, dapo = rldsl.load("grpo"), rldsl.load("dapo")
    for slot in ("shaping", "sampling", "trust_region", "kl", "aggregation"):
        for label, algo in (("grpo", grpo), ("dapo", dapo)):
            for v in algo.slots[slot]:
                first, *rest = v.spec.formula_with(v.params).splitlines()
                assert any(ln.strip() == f"{label}  {first}" for ln in out), (slot, label)
                for line in rest:  # a formula over several lines continues under its first line
                    assert any(ln.strip() == line for ln in out), (slot, label, line)
    same = ["rewards", "baseline", "normalizer", "filter", "correction", "ratio", "objective", "distill",
            "selection", "entropy", "router", "critic"]
    assert not any(ln.startswith("= ") and ln.split()[1] in same for ln in out if "not shown" not in ln)
    assert f"= {len(same)} identical slot(s) not shown (--all shows them): {', '.join(same)}" in out
    assert out[-1] == "5 slot(s) differ"
    assert not any(c in res.output for c in "│┃━─")  # no table

    full = _lines(runner.invoke(app, ["explain", "grpo", "dapo", "--all"]).output)
    assert "= baseline      group_mean(singleton=zero)" in full and "= critic        none" in full
    assert not any("not shown" in ln for ln in full)
    assert {ln for ln in out if "not shown" not in ln} <= set(full)
    assert runner.invoke(app, ["explain", "grpo", "--all"]).exit_code == 2


def test_json_diff_does_not_fold():
    d = json.loads(runner.invoke(app, ["explain", "grpo", "dapo", "--all", "--format", "json"]).output)
    assert len(d["slots"]) == len(registry.SLOTS)
    assert json.loads(runner.invoke(app, ["explain", "grpo", "dapo", "--format", "json"]).output) == d


def test_user_text_is_printed_literally(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "30")
    text = "[bold]Keep[/bold] 1[max r != min r] :thumbs_up: [link=x]y[/link]"
    good = tmp_path / "lit.rl"
    good.write_text(f'algorithm lit extends grpo\n  "{text}"\n  filter zero_variance\n')
    out = runner.invoke(app, ["explain", str(good)]).output
    assert text in out and "keep_i = 1[max_{g(i)} r != min_{g(i)} r]" in out
    diff = runner.invoke(app, ["explain", "grpo", str(good)]).output
    assert "≠ filter        none -> zero_variance" in diff
    assert "lit   keep_i = 1[max_{g(i)} r != min_{g(i)} r]" in diff  # labels padded to "from"
    bad = tmp_path / "bad[red].rl"
    bad.write_text(f'algorithm bad\n  "{text}"\n  baseline group_mena  # [x] :smile:\n')
    res = runner.invoke(app, ["check", str(bad)])
    assert res.exit_code == 2
    assert f"{bad}:3:12: error: unknown baseline 'group_mena'" in res.output
    assert "baseline group_mena  # [x] :smile:" in res.output
    ok = runner.invoke(app, ["check", str(good)]).output
    assert f"ok: {good}: algorithm lit (extends grpo)" in ok


def test_list_wraps_to_100_columns_when_piped():
    """`rldsl list | cat`: long lines break at spaces (a list of choices after a '|'), each
    continuation indented under its text; nothing is lost."""
    res = runner.invoke(app, ["list"])  # CliRunner's stdout is not a terminal
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(ln) for ln in lines) <= 100  # a list of choices breaks after a '|'
    # the overlong penalty's formula continues under its own text, at the formula column
    i = next(i for i, ln in enumerate(lines) if ln.startswith("  overlong_penalty  "))
    assert lines[i + 1].startswith(" " * len("  overlong_penalty  ")) and lines[i + 1].strip()
    words = " ".join(res.output.split())
    assert "-{factor} beyond" in words and "max_len: int, >= 1, required" in words


def test_help_at_80_columns_cuts_nothing(monkeypatch):
    """`rldsl run --help` (and the command list) at 80 columns: every option's text whole, wrapped."""
    import click
    import typer.main
    monkeypatch.setenv("COLUMNS", "80")
    res = runner.invoke(app, ["run", "--help"], terminal_width=80)
    assert res.exit_code == 0, res.output
    assert "…" not in res.output and max(len(ln) for ln in res.output.splitlines()) <= 80
    words = " ".join(res.output.split())
    command = typer.main.get_command(app)
    run = command.commands["run"]
    for param in run.params:
        if isinstance(param, click.Option) and param.help:
            assert " ".join(param.help.split()) in words, param.name
    top = runner.invoke(app, ["--help"], terminal_width=80).output
    assert "..." not in top.split("Commands:")[1] and "…" not in top
    assert "Validate specs; print every error with file:line:col, the line, a caret and a hint." in \
        " ".join(top.split())
