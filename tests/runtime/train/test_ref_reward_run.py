"""The reference model's reward in the runtime (`ref_reward`, reward.reference): each step the
reference answers the step's prompts, the run's reward scores its answers, each row gets its
prompt's mean, recorded in samples.jsonl and logged per term beside the policy's; a spec that
does not read it samples no reference; what the runtime cannot sample it for is refused before any
model loads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rldsl.cli import app
from rldsl.runtime.batch import RolloutBatch
from rldsl.runtime.config import load_config
from rldsl.runtime.data.datasets import Example
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.models.loading import load_policy, load_tokenizer
from rldsl.runtime.resolve import check_reference
from rldsl.runtime.rewards.functions import RewardResult
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.run import loop
from rldsl.runtime.run.plan import load_spec
from rldsl.runtime.train import inputs as producers
from rldsl.runtime.workers.base import Generation
from rldsl.runtime.workers.local import LocalRollouts
from reward_helpers import assert_reference_records
from small_run import small_run, steps_of

ROOT = Path(__file__).resolve().parents[3]
SPEC = str(ROOT / "algorithms" / "examples" / "contrastive_rewards.rl")


def _spy(monkeypatch):
    """Every generate() of every rollouts object: (the object, prompts, params, its Generation)."""
    calls: list[tuple[object, list, object, object]] = []
    gen = LocalRollouts.generate

    def generate(self, prompts, answers, params, reward_prompts=None, score=True):
        out = gen(self, prompts, answers, params, reward_prompts, score)
        calls.append((self, list(prompts), params, out))
        return out

    monkeypatch.setattr(LocalRollouts, "generate", generate)
    return calls


def test_a_spec_reading_it_without_a_reference_exits_2_before_any_model_loads(model_dir, tmp_path, no_model_load):
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", SPEC, "--model", str(model_dir), "--out", str(out),
                                   "--set", "reward.name=reward_helpers:parity", "--set", "log.progress=false"])
    assert res.exit_code == 2, res.output
    assert "reads ref_reward" in res.output and "reward.reference=policy_base" in res.output
    assert "Traceback" not in res.output and not out.exists() and no_model_load == []


@pytest.mark.parametrize("spec, sets, said", [
    (SPEC, ["reward.reference=policy_base", "rollout.env=addition_steps"], "multi-turn episodes"),
    (SPEC, ["reward.reference=policy_base", "distributed.rollout_workers=1"], "Ray workers"),
    (SPEC, ["reward.reference=/nowhere/model"], "not a model folder"),
    ("reinforce", ["reward.reference=policy_base"], "reads no reference reward"),
])
def test_what_cannot_sample_the_reference_is_refused_by_name(model_dir, tmp_path, spec, sets, said):
    cfg = load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'run'}", *sets])
    with pytest.raises(ConfigError, match=said):
        check_reference(load_spec(spec), cfg)


def test_a_named_model_folder_or_the_policy_base_passes(model_dir, tmp_path):
    for ref in ("policy_base", str(model_dir)):
        check_reference(load_spec(SPEC), load_config(None, [f"model.path={model_dir}", f"reward.reference={ref}"]))


def test_the_checks_see_a_built_in_tasks_own_tools(tmp_path, no_model_load):
    """The plan settles what the config leaves to its source before any check: the calculator
    task's tools (its episodes) are the run's tools for check_reference too, so a spec reading the
    reference's reward on it is refused before any model loads (the tools were filled in after the
    checks, which passed)."""
    from rldsl.runtime.run.plan import plan_run

    with pytest.raises(ConfigError, match="multi-turn episodes"):
        plan_run(load_spec(SPEC), load_config(None, ["data.task=calculator", "reward.reference=policy_base",
                                                     f"out={tmp_path}"]))
    assert no_model_load == []


@pytest.mark.parametrize("sets", [["rollout.engine=vllm"], ["rollout.max_staleness=1"],
                                  ["rollout.engine=vllm", "rollout.max_staleness=2"]])
def test_the_vllm_engine_and_asynchronous_runs_pass(model_dir, sets):
    """The reference samples on an HF engine of its own whatever the policy's engine, in the step's
    batch maker (an asynchronous run's producer too): neither is refused (their runs: below and
    tests/runtime/run/test_vllm_runs.py)."""
    check_reference(load_spec(SPEC), load_config(None, [f"model.path={model_dir}", "reward.reference=policy_base",
                                                        *sets]))


def test_the_reference_samples_on_an_hf_engine_whatever_the_policys_engine(model_dir):
    """rollout.engine=vllm: the reference is an HF engine of the folder (never synced, so no vLLM: no
    second engine's build nor KV cache), in model.dtype on the run's device."""
    from rldsl.runtime.workers import start

    cfg = load_config(None, [f"model.path={model_dir}", "reward.reference=policy_base", "rollout.engine=vllm"])
    ref = start.reference_rollouts(cfg, load_spec(SPEC), Path(model_dir), None)
    assert isinstance(ref.engine, HFEngine) and next(ref.engine.model.parameters()).dtype == torch.float32


def _batch(B: int, G: int) -> RolloutBatch:
    return RolloutBatch(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long),
                        torch.zeros(B, 2, dtype=torch.long), torch.ones(B, 2), torch.zeros(B, 2),
                        ["stop"] * B, ["p"] * B, ["c"] * B, G)


def test_each_row_gets_its_prompts_mean_over_the_reference_answers_that_did_not_fail():
    """3 prompts x 2 reference answers: (1, 0) -> 0.5; (NaN, 1) -> 1 (the failed one left out);
    (NaN, NaN) -> NaN (the rows then leave the loss); each term likewise, as ref/<term>."""
    nan = float("nan")
    fmt = torch.tensor([0.5, 0.5, nan, 0.0, nan, nan], dtype=torch.float64)
    acc = torch.tensor([0.5, -0.5, nan, 1.0, nan, nan], dtype=torch.float64)
    seen, warned = [], []

    def reference(prompts, answers, params, reward_prompts):
        seen.append((prompts, answers, params, reward_prompts))
        return Generation(_batch(6, 2), RewardResult(fmt + acc, {"fmt": fmt, "acc": acc}, 3, "boom"), 0.25, 0.5)

    side = producers.RolloutSide(None, [("fmt", 1.0), ("acc", 1.0)], 4, warned.append, 7,
                                 reference=reference, reference_params=SamplingParams(n=2, seed=5))
    prompts = [Example(i, f"p{i}", f"a{i}", source=f"s{i}") for i in range(3)]
    batch, seconds = producers.reference_rewards(side, _batch(12, 4), None, prompts)
    assert seen == [(["p0", "p1", "p2"], ["a0", "a1", "a2"], SamplingParams(n=2, seed=5), ["s0", "s1", "s2"])]
    assert seconds == 0.75
    ref = batch.inputs["ref_reward"]
    assert ref.dtype == torch.float32 and ref.shape == (12,)
    torch.testing.assert_close(ref[:8], torch.tensor([0.5] * 4 + [1.0] * 4))
    assert torch.isnan(ref[8:]).all()
    torch.testing.assert_close(batch.reward_terms["ref/fmt"][:8], torch.tensor([0.5] * 4 + [0.0] * 4, dtype=torch.float64))
    torch.testing.assert_close(batch.reward_terms["ref/acc"][:8], torch.tensor([0.0] * 4 + [1.0] * 4, dtype=torch.float64))
    assert len(warned) == 1 and "step 7" in warned[0] and "3 reference answer(s)" in warned[0] and "boom" in warned[0]


@pytest.mark.slow
def test_a_run_reading_the_reference_reward_records_both_rewards_and_trains(model_dir, tmp_path, monkeypatch):
    """2 steps of contrastive_rewards with reward.reference=policy_base, 2 reference answers per
    prompt: one reference generation per step, on the step's prompts; each row's ref_reward is its
    prompt's mean reference reward (samples.jsonl); both rewards per term in the metrics; the
    loss differs from the same run's without the reference (reinforce: the spec without the
    shaping), which samples no reference at all."""
    calls = _spy(monkeypatch)
    sets = ("train.steps=2", "log.samples_per_step=4", "seed=3")
    run = loop.train(SPEC, small_run(model_dir, tmp_path / "ref", *sets, "reward.reference=policy_base",
                                     "reward.reference_samples=2"))
    policy = [c for c in calls if c[2].n == 4]
    reference = [c for c in calls if c[0] is not policy[0][0]]
    assert len(policy) == 2 and len(reference) == 2
    for p, r in zip(policy, reference):
        assert r[1] == p[1] and r[2].n == 2 and r[2].temperature == p[2].temperature
    recs = steps_of(run)
    rows = assert_reference_records(run, reference, recs)
    assert len({r["ref_reward"] for r in rows}) > 1, "the reference's rewards differ between prompts"

    calls.clear()
    plain = loop.train("reinforce", small_run(model_dir, tmp_path / "plain", *sets))
    assert len(calls) == 2 and all(c[2].n == 4 for c in calls), "no reference samples without ref_reward"
    plain_recs = steps_of(plain)
    assert all(not any(k.startswith("rewards/ref/") for k in r) and "time/reference_s" not in r for r in plain_recs)
    assert plain_recs[0]["reward_mean"] == recs[0]["reward_mean"], "the same samples in step 1"
    assert plain_recs[0]["loss"] != pytest.approx(recs[0]["loss"], abs=1e-6)
    assert "ref_reward" not in json.loads((plain / "samples.jsonl").read_text().splitlines()[0])


@pytest.mark.slow
def test_an_asynchronous_run_samples_the_reference_on_each_steps_prompts(model_dir, tmp_path, monkeypatch):
    """rollout.max_staleness=1: the producer samples the reference where it makes a step's batch --
    once per step, on that step's prompts, with the reference's seed of that step -- and each
    row's ref_reward is its prompt's mean reference reward, recorded per term as in a synchronous
    run; the reference's answers equal the synchronous run's (its weights never change)."""
    calls = _spy(monkeypatch)
    sets = ("train.steps=3", "log.samples_per_step=4", "seed=3", "reward.reference=policy_base",
            "reward.reference_samples=2")
    run = loop.train(SPEC, small_run(model_dir, tmp_path / "async", *sets, "rollout.max_staleness=1"))
    policy = [c for c in calls if c[2].n == 4]
    reference = [c for c in calls if c[0] is not policy[0][0]]
    assert len(policy) == 3 and len(reference) == 3
    for p, r in zip(policy, reference):
        assert r[1] == p[1] and r[2].n == 2
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 16
    for row in rows:
        step_ref = reference[row["step"] - 1][3].scored.rewards.view(-1, 2)
        assert row["ref_reward"] == pytest.approx(float(step_ref[row["group"]].mean()), abs=1e-7)
        assert row["rewards"]["ref/parity"] == pytest.approx(row["ref_reward"], abs=1e-7)
    for rec, r in zip(recs, reference):
        assert rec["rewards/ref/parity/mean"] == pytest.approx(float(r[3].scored.rewards.double().mean()), abs=1e-12)

    calls.clear()
    loop.train(SPEC, small_run(model_dir, tmp_path / "sync", *sets))
    sync_ref = [c for c in calls if c[2].n == 2]
    assert [c[3].batch.completions for c in sync_ref] == [c[3].batch.completions for c in reference]


@pytest.mark.slow
def test_policy_base_with_lora_samples_the_base_model(model_dir, tmp_path, monkeypatch):
    """With LoRA and a learning rate that moves the adapters, the reference's answers at step 3 are
    the base model's (a fresh HF engine on the folder, same sampling) while the policy's own
    engine, synced with the adapters merged, answers otherwise."""
    calls = _spy(monkeypatch)
    loop.train(SPEC, small_run(model_dir, tmp_path / "run", "model.lora.rank=4", "model.lora.alpha=64",
                               "train.lr=0.5", "reward.reference=policy_base"))
    policy_obj = next(c[0] for c in calls if c[2].n == 4)
    last = [c for c in calls if c[0] is not policy_obj][-1]
    _, prompts, params, got = last
    base = HFEngine(load_policy(model_dir, "float32"), load_tokenizer(model_dir))
    assert base.generate(prompts, params).completions == got.batch.completions
    assert policy_obj.engine.generate(prompts, params).completions != got.batch.completions, \
        "the trained policy answers otherwise: the test tells the base from the policy"


@pytest.mark.slow
def test_a_named_model_folder_is_the_reference(model_dir, tmp_path, monkeypatch):
    """reward.reference=PATH: the reference's answers are that folder's model's (another tiny model,
    other weights), not the policy's."""
    from transformers import LlamaForCausalLM

    other = tmp_path / "other"
    torch.manual_seed(1)
    LlamaForCausalLM(load_policy(model_dir, "float32").config).save_pretrained(other)
    load_tokenizer(model_dir).save_pretrained(other)
    calls = _spy(monkeypatch)
    loop.train(SPEC, small_run(model_dir, tmp_path / "run", "train.steps=1", f"reward.reference={other}"))
    policy_obj = next(c[0] for c in calls if c[2].n == 4)
    (_, prompts, params, got), = [c for c in calls if c[0] is not policy_obj]
    assert HFEngine(load_policy(other, "float32"), load_tokenizer(other)).generate(prompts, params).completions \
        == got.batch.completions
    assert HFEngine(load_policy(model_dir, "float32"), load_tokenizer(model_dir)).generate(
        prompts, params).completions != got.batch.completions


@pytest.mark.slow
def test_a_loss_formula_reads_each_rows_reference_reward_in_micro_batches(model_dir, tmp_path, monkeypatch):
    """A loss formula reading ref_reward: every micro-batch's loss() gets its rows' values (over the
    step's micro-batches, each row's value once), and the run trains."""
    import rldsl
    from rldsl.runtime.train.trainer import Trainer

    spec = tmp_path / "margin.rl"
    spec.write_text("algorithm margin extends reinforce\n  define margin\n"
                    "    l = -A * (1 + reward - ref_reward) * logp\n  end\n  objective  margin\n")
    made, given = [], []
    est, loss = Trainer.estimate, rldsl.CompiledAlgorithm.loss

    def estimate(self, rollout, rewards):
        made.extend(zip(rewards.tolist(), rollout.inputs["ref_reward"].tolist()))
        return est(self, rollout, rewards)

    def spy_loss(self, *args, **kw):
        given.append(list(zip(kw["sequence_rewards"].tolist(), kw["ref_reward"].tolist())))
        return loss(self, *args, **kw)

    monkeypatch.setattr(Trainer, "estimate", estimate)
    monkeypatch.setattr(rldsl.CompiledAlgorithm, "loss", spy_loss)
    run = loop.train(str(spec), small_run(model_dir, tmp_path / "run", "train.steps=1", "reward.reference=policy_base",
                                          "reward.reference_samples=3", "train.max_tokens_per_microbatch=24"))
    assert len(made) == 16 and len(given) > 1, "the step's rows in more than one micro-batch"
    assert len({ref for _, ref in made}) > 1, "prompts with different reference rewards"
    assert sorted(p for micro in given for p in micro) == sorted(made)  # (reward, ref_reward) of each row, once
    assert [r["step"] for r in steps_of(run)] == [1]


@pytest.mark.slow
def test_a_prompt_whose_reference_answers_all_failed_leaves_the_loss(model_dir, tmp_path):
    """reward.on_error=skip with a reward that fails on completions starting with '1': a prompt whose
    reference answer failed has ref_reward null in samples.jsonl and its rows leave the loss
    (advantage 0, counted in filtered_rows, not in nonfinite_rewards: the policy's own rewards)."""
    run = loop.train(SPEC, small_run(model_dir, tmp_path / "run", "train.steps=2", "log.samples_per_step=4",
                                     "reward.reference=policy_base", "reward.name=reward_helpers:explode",
                                     "reward.on_error=skip", "reward.max_skipped_steps=0"))
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    failed = [r for r in rows if r["ref_reward"] is None]
    assert failed and len(failed) < len(rows), "this seed's reference fails on some prompts, not all"
    assert all(r["advantage"] == 0.0 and r["rewards"]["ref/explode"] is None for r in failed)
    for rec in steps_of(run):
        step_rows = [r for r in rows if r["step"] == rec["step"]]
        out = {(r["group"], i) for i, r in enumerate(step_rows) if r["ref_reward"] is None or r["reward"] is None}
        assert rec["filtered_rows"] == len(out)
        assert rec["nonfinite_rewards"] == sum(r["reward"] is None for r in step_rows)
