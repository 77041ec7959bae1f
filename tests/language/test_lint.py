"""Spec warnings (rldsl/lint.py): each rule fires on its slip, no library spec fires any spec
rule, and `rldsl check` prints them like errors (exit 0 unless --strict)."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

import rldsl
from rldsl import lint
from rldsl.cli import app

RUN = lint.RunFacts(group_size=8, max_new_tokens=1024, engine="vllm", exact_logprobs=False)

# rule -> (spec body extending grpo, message fragment, line:col of the caret)
SPEC_SLIPS = {
    "weight-bound-excludes-1": ("  objective is_weighted\n  trust_region truncate(high=-0.8)\n",
                                "truncate(high=-0.8) caps the weight at 1 + high = 0.2 < 1", "3:25"),
    "zero-coefficient": ("  kl k1(beta=0.0, where=reward)\n", "kl k1(beta=0.0) multiplies the term by 0", "2:9"),
    "epsilon-as-bound": ("  trust_region clip(low=0.2, high=1.28)\n", "lets the ratio rise to 1 + 1.28 = 2.28",
                         "2:30"),
    "clip-higher-reversed": ("  trust_region dual_clip(low=0.28, high=0.2)\n",
                             "high=0.2 is below low=0.28", "2:36"),
    "zero-denominator-eps": ("  normalizer batch_std(eps=0.0)\n", "batch_std(eps=0.0): equal rewards", "2:24"),
    "inert-dynamic-sampling": ("  sampling dynamic(max_rounds=1)\n", "allows one round", "2:20"),
    "dense-rewards-unread": ("  rewards dense\n", "rewards dense: no component reads per-token rewards", "2:11"),
    "empty-band": ("  ratio token(clamp=80.0)\n  trust_region clip(low=0.2, high=0.2)\n"
                   "  selection clip_cov(lb=5.0, ub=1.0)\n", "the band (lb, ub) = (5.0, 1.0) is empty", "4:30"),
}


def _spec(body: str) -> rldsl.Algorithm:
    return rldsl.loads("algorithm slip extends grpo\n" + body, "slip.rl")


def test_every_rule_has_a_case_and_a_summary() -> None:
    assert set(SPEC_SLIPS) == set(lint.SPEC_RULES)
    for rule in [*lint.SPEC_RULES.values(), *lint.RUN_RULES.values()]:
        assert lint.summary(rule)


@pytest.mark.parametrize("rule", sorted(SPEC_SLIPS))
def test_spec_rule_fires_at_the_argument(rule: str) -> None:
    body, fragment, where = SPEC_SLIPS[rule]
    warnings = lint.check(_spec(body))
    assert [w.rule for w in warnings] == [rule]
    text = warnings[0].render()
    assert text.startswith(f"slip.rl:{where}: warning: ") and fragment in text, text
    assert "^" in text and "= help: " in text


def test_more_weight_bounds_that_leave_out_1() -> None:
    for body in ("  correction importance(level=token, high=0.9)\n",
                 "  correction importance(level=token, mode=mask, low=1.5, high=5.0)\n"):
        assert [w.rule for w in lint.check(_spec(body))] == ["weight-bound-excludes-1"], body
    assert lint.check(_spec("  correction importance(level=token, mode=mask, low=0.5, high=5.0)\n")) == []


def test_entropy_bonus_with_coefficient_0() -> None:
    ws = lint.check(_spec("  entropy bonus(coef=0.0)\n"))
    assert [w.rule for w in ws] == ["zero-coefficient"] and "write `entropy none`" in ws[0].render()


def test_a_slip_in_a_parent_points_at_the_parent(tmp_path) -> None:
    (tmp_path / "parent.rl").write_text("algorithm parent extends grpo\n  kl k3(beta=0.0, where=loss)\n")
    child = tmp_path / "child.rl"
    child.write_text("algorithm child extends parent\n  aggregation token_mean\n")
    (w,) = lint.check(rldsl.load(child))
    assert w.render().splitlines()[:2] == [
        f"{tmp_path / 'parent.rl'}:2:9: warning: kl k3(beta=0.0) multiplies the term by 0",
        "   2 |   kl k3(beta=0.0, where=loss)"]


@pytest.mark.parametrize("name", sorted(rldsl.library()))
def test_no_library_spec_has_a_spec_warning(name: str) -> None:
    assert lint.check(rldsl.load(name)) == []
    assert lint.check_run(rldsl.load(name), RUN) == [] or name in ("dapo", "dr_grpo")


def test_run_rules() -> None:
    one = lint.RunFacts(group_size=1, max_new_tokens=4096, engine="hf", exact_logprobs=True)
    rules = lambda name, run: [w.rule for w in lint.check_run(rldsl.load(name), run)]  # noqa: E731
    assert rules("dr_grpo", one) == ["group-of-one"]  # its 4096 is the budget here
    assert rules("dr_grpo", RUN) == ["budget-mismatch"]
    assert rules("dapo", one) == ["budget-mismatch", "dynamic-sampling-one-sample", "group-of-one", "group-of-one"]
    assert rules("grpo_tis", one)[-1] == "correction-on-exact-engine"
    assert "correction-on-exact-engine" not in rules("grpo_tis", RUN)
    # bypass on the HF engine only skips a forward it would repeat exactly; and then the other corrections
    # compare pi_theta with the engine's logprobs, which drift apart over minibatches: no warning
    exact = lint.RunFacts(group_size=8, max_new_tokens=4, engine="hf", exact_logprobs=True)
    for line in ("correction bypass", "correction bypass, reject(stat=seq_mean_k3, high=0.01)"):
        assert lint.check_run(_spec(f"  {line}\n"), exact) == [], line
    assert [w.rule for w in lint.check_run(_spec("  correction reject(stat=seq_mean_k3, high=0.01)\n"), exact)] == \
        ["correction-on-exact-engine"]
    assert rules("reinforce", one) == [] and rules("ppo", one) == []  # no group statistic
    # distillation alone (distill task=false): grpo's baseline and std feed no term of the loss;
    # a task term beside the distillation reads them; a zero-variance filter masks every term
    assert rules("gkd", one) == rules("opd", one) == rules("distill_topk", one) == []
    assert rules("grpo_distill", one) == ["group-of-one", "group-of-one"]
    alone = "  distill jsd(task=false)\n"
    assert [w.rule for w in lint.check_run(_spec(alone + "  filter zero_variance\n"), one)] == ["group-of-one"]
    assert [w.rule for w in lint.check_run(_spec(alone.replace("false", "true")), one)] == ["group-of-one"] * 2
    (w,) = [w for w in lint.check_run(rldsl.load("dr_grpo"), RUN)]
    assert "token_sum_norm(max_tokens=4096) is not the run's generation budget rollout.max_new_tokens=1024" \
        in w.render() and "--set rollout.max_new_tokens=4096" in w.render()


def test_geo_mean_log_space_bounds_and_a_full_band_are_not_slips() -> None:
    """GMPO's bounds are log-space (0.4 is the paper's; >= 1 is legal, not an offset slip): geo_mean declares
    no epsilon roles. clip_cov's band warns only when empty."""
    body = "  ratio geo_mean(low=1.5, high=0.4)\n  trust_region none\n"
    assert lint.check(_spec(body)) == []
    assert lint.check(_spec("  ratio token(clamp=80.0)\n  trust_region clip(low=0.2, high=0.2)\n"
                            "  selection clip_cov(lb=1.0, ub=1.5)\n")) == []


def test_check_prints_warnings_and_fails_only_with_strict(tmp_path) -> None:
    f = tmp_path / "slip.rl"
    f.write_text("algorithm slip extends grpo\n  trust_region clip(low=0.2, high=1.28)\n")
    r = CliRunner().invoke(app, ["check", str(f)])
    assert r.exit_code == 0, r.output
    assert f"{f}:2:30: warning: trust_region clip(high=1.28)" in r.output and "(1 warning)" in r.output
    r = CliRunner().invoke(app, ["check", "--strict", str(f), "grpo"])
    assert r.exit_code == 2 and "1 of 2 files with warnings (--strict)" in r.output
    assert CliRunner().invoke(app, ["check", "--strict", "grpo", "dapo"]).exit_code == 0


def test_check_help_lists_every_rule() -> None:
    text = CliRunner().invoke(app, ["check", "--help"], terminal_width=200).output
    for name in [*lint.SPEC_RULES, *lint.RUN_RULES]:
        assert name in text, name


def test_docs_list_every_rule() -> None:
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "warnings.md").read_text(encoding="utf-8")
    for name, rule in [*lint.SPEC_RULES.items(), *lint.RUN_RULES.items()]:
        assert f"| `{name}` | {lint.summary(rule)} |" in doc, name
