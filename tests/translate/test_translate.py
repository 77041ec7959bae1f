"""`rldsl translate`: TRL / verl configs to specs. The code's tables agree with docs/peers.md,
every fixture translates to a spec that checks and a run config that loads, and options that
cannot be reproduced are named (exit 2, or warning comments with --lenient)."""
from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

import rldsl
from rldsl import translate as tr
from rldsl.cli import app
from rldsl.runtime.config import load_config

HERE = Path(__file__).parent
DOC = (HERE.parent.parent / "docs" / "peers.md").read_text(encoding="utf-8")
BYPASS = "verl `algorithm.rollout_correction.loss_type` (with `bypass_mode: true`)"
FIXTURES = sorted(p for p in HERE.iterdir() if p.suffix in (".json", ".yaml"))
UNMAPPABLE = {"trl_unmappable.json": ["sync_ref_model"],
              "verl_distill_k1.yaml": ["distillation.distillation_loss.loss_mode"],
              "trl_vespo_vllm.yaml": ["vllm_importance_sampling_correction"],
              "verl_unmappable.yaml": ["actor_rollout_ref.actor.policy_loss.loss_mode",
                                       "algorithm.use_kl_in_reward"]}
# lines each fixture's spec must hold (the peer's semantics, read from its source)
EXPECT = {
    "trl_dapo.json": ["trust_region  clip(low=0.2, high=0.28)", "aggregation   token_mean", "filter        overlong",
                      "normalizer    group_std(eps=0.0001)", "ratio         token(clamp=80.0)"],
    "trl_grpo.yaml": ["kl            k3(beta=0.04, where=loss, ratio_weighted=true)",
                      "aggregation   seq_mean_token_mean(count_empty=true)"],
    "trl_dr_grpo.yaml": ["aggregation   token_sum_norm(max_tokens=1024)", "baseline      group_mean"],
    "trl_gspo.json": ["ratio         sequence(clamp=80.0)", "trust_region  clip(low=0.0003, high=0.0004)"],
    "trl_cispo.json": ["trust_region  truncate(high=4.0)", "objective     is_weighted",
                       "normalizer    batch_std(eps=0.0001)"],
    "trl_realistic.yaml": ["trust_region  clip(low=0.2, high=0.28)", "filter        overlong",
                           "# ignored (sampling options beyond temperature and top_p: the rollout samples with "
                           "those two only (the completions differ, the algorithm does not)): top_k=50",
                           '# ignored (speed and memory only (the same numbers): rldsl has its own switches '
                           '(train.gradient_checkpointing, train.max_tokens_per_microbatch)): '
                           'gradient_checkpointing_kwargs={"use_reentrant": false}'],
    "trl_vllm_tis.yaml": ["correction    importance(level=token, high=2.0, clamp=80.0)",
                          "selection     top_entropy(quantile=0.2)"],
    "verl_grpo.yaml": ["baseline      group_mean(singleton=reward)", "normalizer    group_std(eps=1e-06)",
                       "trust_region  dual_clip(low=0.2, high=0.2, c=3.0)",
                       "kl            k3(beta=0.001, where=loss, clamp=true)"],
    "verl_opd.yaml": ["distill       reverse_kl(estimator=k1, mode=policy_gradient, coef=1.0, task=false, "
                      "max_clamp=10.0, clip_low=0.2, clip_high=0.2)", "aggregation   token_mean",
                      "# note: distillation_loss_coef=0.5 is ignored without use_task_rewards (verl uses 1)",
                      'path = "/models/teacher"'],
    "verl_distill_topk.yaml": ["distill       forward_kl_topk(k=16, log_prob_min_clamp=-10.0, mode=supervised, "
                               "coef=0.3, task=true)", "trust_region  dual_clip(low=0.2, high=0.2, c=3.0)"],
    "trl_distillation.yaml": ["distill       jsd(beta=0.5, temperature=0.9, mode=supervised, task=false)",
                              "aggregation   token_mean", "kl            none", 'path = "/models/teacher"',
                              "temperature = 0.9", "n = 1"],
    "verl_dapo.yaml": ["trust_region  dual_clip(low=0.2, high=0.28, c=10.0)", "sampling      dynamic(max_rounds=10)",
                       "shaping       overlong_penalty(max_len=20480, cache=4096, factor=1.0)"],
    "verl_ppo_gae.yaml": ["baseline      gae(gamma=1.0, lam=0.95)", "critic        value(clip=0.5)",
                          "kl            k1(beta=0.02, where=reward)",
                          "aggregation   seq_mean_token_mean(count_empty=true)"],
    "verl_rloo.yaml": ["baseline      leave_one_out(singleton=reward)", "objective     reinforce",
                       "aggregation   seq_mean_token_sum(count_empty=true)"],
    "verl_reinforce_pp.yaml": ["baseline      return_to_go(gamma=1.0)", "normalizer    whiten",
                               "kl            k1(beta=0.01, where=reward)"],
    "verl_rollout_correction.yaml": [
        "correction    importance(level=sequence, high=2.0), reject(stat=seq_sum_k1, low=0.5, high=2.0)"],
    "verl_gmpo.yaml": ["ratio         geo_mean(low=0.4, high=0.4)", "trust_region  none",
                       "aggregation   seq_mean_token_mean(count_empty=true)",
                       # verl cannot turn on the +-20 clamp gmpo.rl has; its grpo baseline keeps singletons
                       "# closest library spec: algorithms/gmpo.rl (differs in baseline, ratio)"],
    "verl_clip_cov.yaml": ["ratio         token(clamp=80.0)", "trust_region  clip(low=0.2, high=0.28)",
                           "selection     clip_cov(ratio=0.0002, lb=1.0, ub=5.0, seed=0)",
                           "# note: verl draws clip_cov's dropped tokens from the global torch generator (no config "
                           "field seeds it); seed=0 gives the choice verl makes after torch.manual_seed(0)"],
    "verl_kl_cov.yaml": ["ratio         token(clamp=80.0)", "objective     kl_cov(ratio=0.002, coef=1.0)",
                         "aggregation   token_mean"],
    "verl_bypass_pg_geo_rs_seq_tis.yaml": [
        "correction    bypass, importance(level=sequence, high=2.0), reject(stat=seq_mean_k1, low=0.999, high=1.001)",
        "objective     reinforce"],
    "verl_bypass_ppo_clip_k3_rs.yaml": [
        "correction    bypass, reject(stat=seq_mean_k3, high=0.01)", "trust_region  dual_clip(low=0.2, high=0.28, c=3.0)",
        "objective     ppo"],
    "verl_cispo.yaml": ["trust_region  truncate(high=0.2)", "# closest library spec: algorithms/cispo.rl "
                                                             "(differs in baseline)"],
    "verl_realistic.yaml": ["kl            k3(beta=0.001, where=loss, clamp=true)"],
}
RUN = {"trl_dapo.json": {"rollout.n": 8, "rollout.max_new_tokens": 1024, "rollout.prompts_per_step": 8,
                         "train.minibatches": 2, "model.dtype": "bfloat16", "seed": 42},
       # a user's recipe: every ordinary field carried into a run key, or ignored with its reason
       "trl_realistic.yaml": {"model.path": "Qwen/Qwen2.5-0.5B-Instruct", "model.dtype": "bfloat16", "seed": 7,
                              "model.lora.rank": 32, "model.lora.alpha": 64.0,
                              "model.lora.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                              "train.lr_schedule": "linear", "train.warmup_steps": 10, "train.steps": 200,
                              "train.betas": (0.9, 0.99), "train.grad_clip": 0.2, "train.gradient_checkpointing": True,
                              "data.chat_template_kwargs": {"enable_thinking": False},
                              "rollout.prompts_per_step": 8, "rollout.top_p": 0.95,
                              "data.path": "trl-lib/DeepMath-103K", "log.report_to": ["wandb"]},
       # a verl run as users write it: its model, data files, trackers, save and test frequencies
       "verl_realistic.yaml": {"model.path": "Qwen/Qwen2.5-3B-Instruct", "data.path": "~/data/gsm8k/train.parquet",
                               "eval.data": ["~/data/gsm8k/test.parquet"], "data.prompt_key": "prompt",
                               "log.report_to": ["wandb"], "log.project": "verl_grpo_example_gsm8k",
                               "eval.every": 5, "checkpoint.every": 20, "train.lr": 1e-6,
                               "train.gradient_checkpointing": True},
       # vllm where the command runs has no GPU (the autouse fixture below): the hf engine, with a note
       "verl_grpo.yaml": {"rollout.n": 5, "rollout.max_new_tokens": 1024, "rollout.prompts_per_step": 1024,
                          "train.minibatches": 4, "train.steps": 300, "rollout.engine": "hf"},
       "verl_ppo_gae.yaml": {"rollout.n": 1, "train.critic_lr": 1e-5, "train.minibatches": 4}}


# ---------------------------------------------------------------------------------------
# The tables in code and in docs/peers.md


def _table(heading: str) -> dict[str, list[str]]:
    """Option -> the doc's spec lines, from the table under ``## heading``."""
    body = DOC.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in body.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        names = re.findall(r"`([^`]+)`", cells[0])
        spec = [] if "not expressible" in cells[1] or "planned" in cells[1] else \
            [m.replace("\\|", "|") for m in re.findall(r"`([^`]+)`", cells[1])]
        for n in names:
            rows[re.sub(r'^\w+="(\w+)"$', r"\1", n)] = spec
    return rows


def _doc_form(rows: tuple[str, ...]) -> list[str]:
    return [re.sub(r"\{(\w+)\}", lambda m: tr.DOC_NAMES.get(m.group(1), m.group(1).upper()), r) for r in rows]


@pytest.mark.parametrize("heading, table", [
    ("TRL `GRPOConfig`", tr.TRL_LOSS_TYPES), ("TRL `GRPOConfig`", tr.TRL_SCALE_REWARDS),
    ("TRL `GRPOConfig`", tr.TRL_MULTI_OBJECTIVE),
    ("verl `actor.policy_loss.loss_mode`", tr.VERL_LOSS_MODES),
    ("verl `algorithm.adv_estimator`", tr.VERL_ADV_ESTIMATORS),
    ("verl `actor.loss_agg_mode`", tr.VERL_AGG_MODES), ("verl `actor.kl_loss_type`", tr.VERL_KL_TYPES),
    (BYPASS, tr.VERL_BYPASS_LOSS_TYPES)])
def test_the_code_tables_are_the_doc_tables(heading, table) -> None:
    doc = _table(heading)
    for option, rows in table.items():
        assert option in doc, f"{option}: no row in docs/peers.md ## {heading}"
        assert doc[option] == _doc_form(rows), option


def test_every_doc_row_is_translated_or_named_unsupported() -> None:
    tables = {"verl `actor.policy_loss.loss_mode`": ("loss_mode", tr.VERL_LOSS_MODES),
              "verl `algorithm.adv_estimator`": ("adv_estimator", tr.VERL_ADV_ESTIMATORS),
              "verl `actor.kl_loss_type`": ("kl_loss_type", tr.VERL_KL_TYPES)}
    for heading, (kind, table) in tables.items():
        for option, spec in _table(heading).items():
            if option == "bypass_mode":  # a rollout_correction switch: its own table, every row translated
                assert set(_table(BYPASS)) == set(tr.VERL_BYPASS_LOSS_TYPES)
                assert not any("bypass" in k for _, k in tr.UNSUPPORTED)
            elif spec:
                assert option in table, f"{heading}: {option} is in the doc, not in the code"
            else:
                assert ("verl", f"{kind}={option}") in tr.UNSUPPORTED, option
    trl = _table("TRL `GRPOConfig`")
    assert trl["use_adaptive_entropy"] == ["entropy adaptive(init=ENTROPY_COEF, min=ENTROPY_COEF_MIN, "
                                           "max=ENTROPY_COEF_MAX, delta=ENTROPY_COEF_DELTA, target=ENTROPY_TARGET)"]
    assert not any(k[1].startswith("use_adaptive_entropy") for k in tr.UNSUPPORTED)
    assert set(tr.TRL_LOSS_TYPES) <= set(trl)


# ---------------------------------------------------------------------------------------
# Fixtures end to end


def _spec_and_toml(out: str) -> tuple[str, str]:
    spec = out.split("\n\n# run config", 1)[0]
    toml = out.split("# run config", 1)[1].split("\n", 1)[1].split("\n\n", 1)[0]
    return spec, toml


@pytest.fixture(autouse=True)
def _no_vllm_here(monkeypatch):
    """Translations do not depend on the machine the tests run on: vLLM is unusable here."""
    monkeypatch.setattr(tr, "vllm_usable", lambda: (False, "no CUDA GPU here (rldsl's vLLM engine needs one)"))


@pytest.mark.parametrize("path", [p for p in FIXTURES if p.name not in UNMAPPABLE], ids=lambda p: p.name)
def test_fixture_translates_to_a_spec_that_checks_and_a_config_that_loads(path: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["translate", str(path)])
    assert r.exit_code == 0, r.output
    spec, toml = _spec_and_toml(r.output)
    assert "# WARNING" not in r.output
    for line in EXPECT[path.name]:
        assert line in r.output.splitlines() or "  " + line in r.output.splitlines(), (line, r.output)
    f = tmp_path / f"{path.stem}.rl"
    f.write_text(spec + "\n")
    check = CliRunner().invoke(app, ["check", "--strict", str(f)])
    assert check.exit_code == 0, check.output
    (tmp_path / "run.toml").write_text(toml + "\n")
    cfg = load_config(tmp_path / "run.toml")
    for key, want in RUN.get(path.name, {}).items():
        got = cfg
        for part in key.split("."):
            got = getattr(got, part)
        assert got == want, key
    flags = r.output.strip().splitlines()[-1]
    assert flags.startswith(f"# rldsl run {path.stem}.rl --set ")
    words = shlex.split(flags.removeprefix("# "))  # as a shell reads the line
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    assert load_config(None, sets) == cfg  # the --set line says the same as the TOML


@pytest.mark.parametrize("name", sorted(UNMAPPABLE))
def test_unmappable_options_are_named_and_fail(name: str) -> None:
    r = CliRunner().invoke(app, ["translate", str(HERE / name)])
    assert r.exit_code == 2 and "--lenient" in r.output
    for option in UNMAPPABLE[name]:
        assert f"option {option} cannot be translated: " in r.output, option
    r = CliRunner().invoke(app, ["translate", "--lenient", str(HERE / name)])
    assert r.exit_code == 0, r.output
    for option in UNMAPPABLE[name]:
        assert f"# WARNING: {option} not reproduced: " in r.output
    rldsl.loads(_spec_and_toml(r.output)[0])  # the rest is still a valid spec


def test_trl_defaults_and_the_cispo_cap_footgun(tmp_path: Path) -> None:
    t = tr.translate({})  # every field at TRL 1.16's default: loss_type dapo, epsilon 0.2, beta 0
    assert t.peer == "TRL" and not t.problems
    assert t.lines["trust_region"] == ["trust_region clip(low=0.2, high=0.2)"] and "kl" not in t.lines
    assert t.run["rollout.n"] == 8 and t.run["rollout.max_new_tokens"] == 512 and t.run["train.lr"] == 1e-6
    # TRL's CISPO with epsilon_high unset caps rho at epsilon = 0.2: translated faithfully, and warned
    t = tr.translate({"loss_type": "cispo"})
    assert t.lines["trust_region"] == ["trust_region truncate(high=-0.8)"]
    f = tmp_path / "c.rl"
    f.write_text(t.spec_text("c", "c.json"))
    r = CliRunner().invoke(app, ["check", "--strict", str(f)])
    assert r.exit_code == 2 and "warning: trust_region truncate(high=-0.8) caps the weight" in r.output


def test_trl_delta_is_a_dual_clip() -> None:
    assert tr.translate({"delta": 4.0, "epsilon_high": 0.28}).lines["trust_region"] == \
        ["trust_region dual_clip(low=0.2, high=0.28, c=4.0)"]
    assert tr.translate({"delta": 1.1, "epsilon_high": 0.28}).lines["trust_region"] == \
        ["trust_region dual_clip(low=0.2, high=0.1, c=1.28)"]
    assert [p.option for p in tr.translate({"delta": 0.9}).problems] == ["delta"]


def test_gdpo_from_trl_and_verl_checks(tmp_path: Path) -> None:
    """TRL normalize_then_sum (+ reward_weights) and verl adv_estimator=gdpo translate to
    per_reward_group specs that check; the reward functions and weights go to a note."""
    t = tr.translate({"multi_objective_aggregation": "normalize_then_sum", "reward_weights": [1.0, 0.5],
                      "scale_rewards": "batch"})
    assert not t.problems
    assert t.lines["baseline"] == ["baseline per_reward_group(eps=0.0001, singleton=zero, whiten=samples, "
                                   "whiten_eps=0.0001)"] and t.lines["normalizer"] == ["normalizer none"]
    assert any("reward_weights [1.0, 0.5]" in n for n in t.notes)
    assert [p.option for p in tr.translate({"multi_objective_aggregation": "mean"}).problems] == \
        ["multi_objective_aggregation"]
    v = tr.translate({"algorithm": {"adv_estimator": "gdpo", "gdpo_reward_keys": ["fmt", "acc"],
                                    "gdpo_reward_weights": [0.3, 0.7]}})
    assert not v.problems and v.lines["baseline"] == ["baseline per_reward_group"]
    assert any("['fmt', 'acc']" in n and "--reward" in n for n in v.notes)
    v2 = tr.translate({"algorithm": {"adv_estimator": "gdpo", "norm_adv_by_std_in_grpo": False}})
    assert v2.lines["baseline"] == ["baseline per_reward_group(std=false)"]
    for i, x in enumerate((t, v, v2)):
        f = tmp_path / f"g{i}.rl"
        f.write_text(x.spec_text(f"g{i}", "g.json"))
        r = CliRunner().invoke(app, ["check", str(f)])
        assert r.exit_code == 0, r.output


def test_verl_defaults_and_variants() -> None:
    t = tr.translate({"algorithm": {}})  # verl 0.9.1 defaults: gae, vanilla, token-mean, no KL, n 1
    assert t.peer == "verl" and not t.problems
    assert t.lines["baseline"] == ["baseline gae(gamma=1.0, lam=1.0)"] and t.run["rollout.n"] == 1
    t = tr.translate({"algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": False}})
    assert "normalizer" not in t.lines
    t = tr.translate({"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"actor": {
        "loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 4096,
        "use_kl_loss": True, "kl_loss_type": "k3+", "kl_loss_coef": 0.01}}})
    assert t.lines["aggregation"] == ["aggregation token_sum_norm(max_tokens=4096)"] and not t.problems
    assert t.lines["kl"] == ["kl k3(beta=0.01, where=loss, clamp=true, straight_through=true)"]
    t = tr.translate({"actor_rollout_ref": {"actor": {"loss_agg_mode": "seq-mean-token-sum-norm"}}})
    assert [p.option for p in t.problems] == ["actor_rollout_ref.actor.loss_scale_factor"]
    t = tr.translate({"algorithm": {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}}})
    assert t.lines["correction"] == ["importance(level=token, mode=mask, low=0.5, high=5.0)"]  # IcePop


def test_not_a_config_is_exit_2(tmp_path: Path) -> None:
    f = tmp_path / "x.yaml"
    f.write_text("model:\n  path: x\n")
    r = CliRunner().invoke(app, ["translate", str(f)])
    assert r.exit_code == 2 and "neither a TRL GRPOConfig" in r.output
    f.write_text("- a\n- b\n")
    assert CliRunner().invoke(app, ["translate", str(f)]).exit_code == 2
    assert CliRunner().invoke(app, ["translate", str(tmp_path / "missing.json")]).exit_code == 2


def test_a_typo_in_a_trl_field_is_named() -> None:
    (p,) = tr.translate({"epsilon_hihg": 0.28}).problems  # close to an algorithm option: never guessed
    assert p.option == "epsilon_hihg" and p.why == "not a TRL 1.16 field; did you mean one of 'epsilon', 'epsilon_high'?"
    t = tr.translate({"my_own_field": 1})  # close to nothing: listed, not a failure
    assert not t.problems and t.ignored == {
        "not a field of TRL 1.16's GRPOConfig, ModelConfig or ScriptArguments (check its spelling)": ["my_own_field"]}


def test_nearest_library_spec() -> None:
    assert tr.nearest_library(rldsl.load("dapo").source) == ("dapo", [])
    t = tr.translate({"algorithm": {"adv_estimator": "grpo"}})
    assert "# same as algorithms/" not in tr.render(t, "x.yaml", "x")


def _pl(**policy_loss) -> dict:
    return {"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"actor": {"policy_loss": policy_loss}}}


def test_verl_entropy_mechanism_and_gmpo_defaults() -> None:
    """Absent fields take verl 0.9.1's actor config: clip_ratio 0.2 (log space for geo_mean), clip_cov_ratio
    2e-4 in (1, 5), kl_cov_ratio 2e-4 with ppo_kl_coef 0.1; an explicit null ppo_kl_coef is kl_cov's own 1.0."""
    t = tr.translate(_pl(loss_mode="geo_mean"))
    assert t.lines["ratio"] == ["ratio geo_mean(low=0.2, high=0.2)"] and not t.problems
    t = tr.translate(_pl(loss_mode="clip_cov"))
    assert t.lines["selection"] == ["selection clip_cov(ratio=0.0002, lb=1.0, ub=5.0, seed=0)"]
    assert t.lines["trust_region"] == ["trust_region clip(low=0.2, high=0.2)"]
    assert tr.translate(_pl(loss_mode="kl_cov")).lines["objective"] == ["objective kl_cov(ratio=0.0002, coef=0.1)"]
    assert tr.translate(_pl(loss_mode="kl_cov", ppo_kl_coef=None)).lines["objective"] == \
        ["objective kl_cov(ratio=0.0002, coef=1.0)"]
    assert tr.nearest_library(rldsl.load("gmpo").source) == ("gmpo", [])  # the "same as" line names it


def test_verl_bypass_replaces_the_loss_mode() -> None:
    cfg = _pl(loss_mode="gspo")
    cfg["algorithm"]["rollout_correction"] = {"bypass_mode": True}  # loss_type ppo_clip, no IS, no RS
    t = tr.translate(cfg)
    assert t.lines["correction"] == ["correction bypass"] and "ratio" not in t.lines and not t.problems
    assert t.lines["trust_region"] == ["trust_region dual_clip(low=0.2, high=0.2, c=3.0)"]
    assert any("loss_mode=gspo is ignored" in n for n in t.notes)
    cfg["algorithm"]["rollout_correction"].update(loss_type="reinforce", rollout_is="token")
    t = tr.translate(cfg)
    assert t.lines["correction"] == ["correction bypass", "importance(level=token, high=2.0)"]
    assert t.lines["objective"] == ["objective reinforce"] and "trust_region" not in t.lines
    cfg["algorithm"]["rollout_correction"]["loss_type"] = "ppo"
    assert [p.option for p in tr.translate(cfg).problems] == ["algorithm.rollout_correction.loss_type"]


# ---------------------------------------------------------------------------------------
# Real configs: engines, VESPO with vLLM, --out, --verify


def test_vllm_translates_to_the_engine_that_works_here(monkeypatch) -> None:
    verl = {"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"rollout": {"name": "vllm", "n": 4}}}
    t = tr.translate(verl)
    assert t.run["rollout.engine"] == "hf"
    assert any(n.startswith("actor_rollout_ref.rollout.name=vllm: no CUDA GPU here") and
               "--set rollout.engine=vllm" in n for n in t.notes)
    monkeypatch.setattr(tr, "vllm_usable", lambda: (True, ""))
    t = tr.translate(verl)
    assert t.run["rollout.engine"] == "vllm" and not any("rollout.engine" in n for n in t.notes)
    assert tr.translate({"use_vllm": True, "vllm_importance_sampling_correction": False}).run["rollout.engine"] == "vllm"


def test_vespo_with_vllm_importance_sampling_is_refused_by_name() -> None:
    (p,) = tr.translate({"loss_type": "vespo", "use_vllm": True}).problems
    assert p.option == "vllm_importance_sampling_correction" and "phi(w * IS)" in p.why and "phi(w) * IS" in p.why
    t = tr.translate({"loss_type": "vespo", "use_vllm": True, "vllm_importance_sampling_correction": False})
    assert not t.problems and "correction" not in t.lines


def test_warmup_ratio_and_schedules() -> None:
    assert tr.translate({"warmup_ratio": 0.1, "max_steps": 35}).run["train.warmup_steps"] == 4  # ceil(3.5)
    assert tr.translate({"warmup_steps": 0.1, "max_steps": 35}).run["train.warmup_steps"] == 4  # transformers 5
    assert tr.translate({"warmup_steps": 3, "warmup_ratio": 0.5, "max_steps": 35}).run["train.warmup_steps"] == 3
    t = tr.translate({"warmup_ratio": 0.1})  # no max_steps: nothing to take a fraction of
    assert "train.warmup_steps" not in t.run and not t.problems
    assert any("warmup_ratio=0.1" in opts for opts in t.ignored.values())
    assert tr.translate({}).run["train.lr_schedule"] == "linear"  # TRL's default
    assert tr.translate({"lr_scheduler_type": "constant_with_warmup"}).run["train.lr_schedule"] == "constant"
    t = tr.translate({"lr_scheduler_type": "polynomial", "optim": "adafactor"})
    assert not t.problems and "train.lr_schedule" not in t.run
    assert sorted(o for opts in t.ignored.values() for o in opts) == ["lr_scheduler_type=polynomial",
                                                                        "optim=adafactor"]


def test_luspo_keeps_the_importance_sampling_level_trl_runs() -> None:
    assert tr.translate({"loss_type": "luspo"}).lines["ratio"] == ["ratio token(clamp=80.0)"]  # TRL's default level
    assert tr.translate({"loss_type": "luspo", "importance_sampling_level": "sequence"}).lines["ratio"] == \
        ["ratio sequence(clamp=80.0)"]
    (p,) = tr.translate({"importance_sampling_level": "sequence", "beta": 0.04}).problems
    assert p.option == "use_bias_correction_kl"  # the KL's ratio weight: same loss, another gradient


def test_out_writes_the_spec_and_the_run_config_apart(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["translate", str(HERE / "trl_realistic.yaml"), "--out", str(tmp_path / "t")])
    assert r.exit_code == 0, r.output
    spec, toml = tmp_path / "t" / "spec.rl", tmp_path / "t" / "run.toml"
    assert r.output.splitlines()[:2] == [f"wrote {spec}", f"wrote {toml}"]
    assert rldsl.load(str(spec)).name == "trl_realistic"
    cfg = load_config(toml)
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.train.warmup_steps == 10
    assert "[train]" not in spec.read_text() and "algorithm" not in toml.read_text()


def test_out_never_writes_over_a_folder_of_files(tmp_path: Path) -> None:
    """--out DIR replaced an existing DIR/spec.rl and DIR/run.toml with exit 0; it is refused as
    export's and ablate's --out are (rldsl/out_folder.py), and the files are left as they were."""
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "spec.rl").write_text("mine")
    r = CliRunner().invoke(app, ["translate", str(HERE / "trl_realistic.yaml"), "--out", str(folder)])
    assert r.exit_code == 2 and f"--out {folder} exists and is not empty" in r.output
    assert (folder / "spec.rl").read_text() == "mine" and not (folder / "run.toml").exists()
    r = CliRunner().invoke(app, ["translate", str(HERE / "trl_realistic.yaml"), "--out", str(folder / "spec.rl")])
    assert r.exit_code == 2 and "is a file, not a folder" in r.output


def test_out_where_no_folder_can_be_made_is_exit_2() -> None:
    """--out /proc/x: /proc takes no new folders though its permissions (and root) say it does; it
    was a FileNotFoundError, exit 1."""
    if not Path("/proc").is_dir():
        pytest.skip("no /proc on this system")
    r = CliRunner().invoke(app, ["translate", str(HERE / "trl_realistic.yaml"), "--out", "/proc/rldsl-t"])
    assert r.exit_code == 2 and "--out /proc/rldsl-t: /proc is not writable" in r.output, r.output


def test_a_file_that_is_not_utf8_or_nests_too_deep_is_exit_2(tmp_path: Path) -> None:
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"learning_rate: 1e-6\n# caf\xe9\n")
    r = CliRunner().invoke(app, ["translate", str(latin)])
    assert r.exit_code == 2 and f"{latin}:2:6: not UTF-8 text (byte 0xe9)" in r.output, r.output
    for suffix, text in ((".json", "[" * 5000 + "]" * 5000), (".yaml", "a: " + "[" * 5000 + "]" * 5000)):
        deep = tmp_path / f"deep{suffix}"
        deep.write_text(text)
        r = CliRunner().invoke(app, ["translate", str(deep)])
        assert r.exit_code == 2 and f"{deep}: lists or tables nested too deeply" in r.output, r.output


def test_verify_runs_trls_own_loss(tmp_path: Path) -> None:
    """--verify: TRL's GRPOTrainer._compute_loss and the translated spec agree; a spec that differs is
    caught (exit 1). TRL is a dev dependency (pyproject's dev extra)."""
    r = CliRunner().invoke(app, ["translate", str(HERE / "trl_realistic.yaml"), "--verify",
                                 "--out", str(tmp_path / "t")])
    assert r.exit_code == 0, r.output
    line = r.output.splitlines()[-1]
    assert line.startswith("verify: TRL 1.16") and "-> the same (tolerance 1e-05)" in line
    from rldsl.verify import verify_translation
    cfg = {"loss_type": "dapo", "beta": 0.04, "top_entropy_quantile": 0.5, "num_generations": 4}
    t = tr.translate(cfg)
    assert verify_translation(cfg, t, t.spec_text("v", "v.yaml")).ok
    wrong = t.spec_text("v", "v.yaml").replace("clip(low=0.2, high=0.2)", "clip(low=0.2, high=0.3)")
    report = verify_translation(cfg, t, wrong)
    assert not report.ok and "-> DIFFERENT" in report.lines[-1]
    # adaptive entropy: both controllers first step on a low-entropy batch, so the bonus compared is not 0
    cfg = {"loss_type": "dapo", "use_adaptive_entropy": True, "entropy_coef": 0.05, "num_generations": 4}
    t = tr.translate(cfg)
    assert verify_translation(cfg, t, t.spec_text("a", "a.yaml")).ok
    no_bonus = t.spec_text("a", "a.yaml").replace("entropy       adaptive(init=0.05", "entropy       adaptive(init=0.5")
    assert no_bonus != t.spec_text("a", "a.yaml") and not verify_translation(cfg, t, no_bonus).ok


def test_verify_says_what_it_cannot_verify(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["translate", str(HERE / "verl_grpo.yaml"), "--verify"])
    verl_here = importlib.util.find_spec("verl") is not None
    assert r.exit_code == 2 and ("verl's core_algos is not implemented yet" if verl_here
                                 else "--verify: verl is not installed here") in r.output
    r = CliRunner().invoke(app, ["translate", str(HERE / "trl_vllm_tis.yaml"), "--verify"])
    assert r.exit_code == 2 and "vLLM importance weights inside its generation step" in r.output


def test_every_key_of_a_verl_config_is_used_or_listed_as_ignored() -> None:
    """verl: the keys no rule reads are listed (with their reason), as TRL's are; numbers YAML gave
    as text (`lr: 1e-6`) are written as numbers."""
    cfg = tr.read_config(HERE / "verl_realistic.yaml")
    assert cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] == "1e-6"  # what PyYAML reads
    t = tr.translate(cfg)
    ignored = {o.split("=", 1)[0] for options in t.ignored.values() for o in options}
    assert ignored == {"trainer.logger", "data.max_prompt_length", "data.filter_overlong_prompts",
                       "actor_rollout_ref.model.use_remove_padding", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                       "actor_rollout_ref.actor.fsdp_config.param_offload",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size",
                       "actor_rollout_ref.rollout.gpu_memory_utilization", "trainer.experiment_name",
                       "trainer.n_gpus_per_node", "trainer.nnodes", "trainer.total_epochs"}
    assert "trainer.logger=console" in t.ignored["rldsl prints its own progress and writes metrics.jsonl"]
    assert t.run["train.lr"] == 1e-6 and isinstance(t.run["train.lr"], float)
    assert "lr = 1e-06" in tr.run_toml(t)
    several = tr.translate({**cfg, "data": {**cfg["data"], "train_files": ["a.parquet", "b.parquet"]}})
    assert "data.path" not in several.run  # not half the data: the run then says data.path is missing
    assert any(o.startswith("data.train_files=") for options in several.ignored.values() for o in options)


def test_trl_report_to_dataset_and_numbers_as_text() -> None:
    t = tr.translate({"learning_rate": "1e-6", "max_grad_norm": "0.5", "report_to": ["wandb", "comet_ml"],
                      "dataset_name": "data/train.jsonl", "model_name_or_path": "./my-model", "project": "p"})
    assert t.run["train.lr"] == 1e-6 and t.run["train.grad_clip"] == 0.5
    assert t.run["log.report_to"] == ["wandb"] and t.run["log.project"] == "p"
    assert t.run["data.path"] == "data/train.jsonl" and t.run["model.path"] == "./my-model"
    assert t.ignored["log.report_to takes tensorboard, wandb, trackio, mlflow"] == ["report_to=comet_ml"]
    assert tr.translate({"report_to": "none"}).run["log.report_to"] == []
    assert tr.translate({"report_to": "all"}).run["log.report_to"] == list(tr.RUN_TRACKERS)


def test_the_trackers_translate_knows_are_the_runtimes() -> None:
    from rldsl.runtime.records.trackers import TRACKERS
    assert tuple(tr.RUN_TRACKERS) == tuple(TRACKERS)
