"""One precision end to end (``model.dtype``): the engine samples and the trainer's forwards
compute in the same dtype (float32 master weights under bfloat16/float16), and float16 trains
with dynamic loss scaling: an inf gradient skips the step and halves the scale, the next finite
step goes through; gradients are unscaled before the gradient norm and clipping."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import rldsl
from rldsl.runtime.config import load_config
from rldsl.runtime.recipe import master_policy, rollout_engine
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.loss_scale import LossScaler
from rldsl.runtime.train.trainer import Trainer

SPEC = """algorithm t
  baseline      group_mean
  objective     ppo
  trust_region  clip(low=0.2, high=0.2)
  aggregation   token_mean
"""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _batch(model, tokenizer):
    batch = HFEngine(model, tokenizer).generate(
        ["1+2=", "33+44="], SamplingParams(n=4, temperature=1.5, max_new_tokens=6, seed=0))
    return batch, torch.tensor([1.0, 0.0] * 4)


@pytest.mark.parametrize("name", list(DTYPES))
def test_model_dtype_is_the_engines_and_the_trainer_forwards(name, model_dir, tokenizer):
    """config -> the hf engine's weights and the trainer's forward compute in ``model.dtype``;
    the trainer's parameters (and gradients) stay float32; float16 alone gets a loss scaler."""
    cfg = load_config(None, [f"model.path={model_dir}", f"model.dtype={name}", "train.skip_zero_advantage=false"])
    engine = rollout_engine(cfg, model_dir, "cpu")
    assert {p.dtype for p in engine.model.parameters()} == {DTYPES[name]}
    batch = engine.generate(["1+2="], SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0))
    assert torch.isfinite(batch.logprobs[batch.response_mask > 0]).all()

    policy = master_policy(cfg, model_dir, "cpu")
    fn = rldsl.compile(rldsl.loads(SPEC, "t.rl"), compile=False)
    trainer = Trainer.from_config(cfg, fn, policy)
    seen = []
    policy.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    rewards = torch.tensor([1.0, 0.0])
    trainer.update(trainer.estimate(batch, rewards))
    seen.clear()  # (the first update also ran the once-per-model packing probes, in float32 by design)
    m = trainer.update(trainer.estimate(batch, rewards))
    assert seen and set(seen) == {DTYPES[name]}
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in policy.parameters() if p.grad is not None} == {torch.float32}
    assert (trainer.loss_scaler is not None) == (name == "float16")
    assert ("train/loss_scale" in m) == (name == "float16")


def test_float16_loss_scaler_skips_an_inf_gradient_and_recovers(tiny_model, tokenizer):
    batch, rewards = _batch(tiny_model, tokenizer)
    fn = rldsl.compile(rldsl.loads(SPEC, "t.rl"), compile=False)
    model = copy.deepcopy(tiny_model)
    t = Trainer(fn, model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), skip_zero_advantage=False,
                autocast_dtype=torch.float16, loss_scaler=LossScaler())
    assert t.loss_scaler is not None and t.loss_scaler.scale == 2.0 ** 16
    before = copy.deepcopy(model.state_dict())
    weight = model.model.layers[0].mlp.up_proj.weight
    hook = weight.register_hook(lambda g: torch.full_like(g, math.inf))  # an overflow in the backward
    m = t.update(t.estimate(batch, rewards))
    hook.remove()
    assert m["optimizer_steps"] == 0 and m["skipped_nonfinite"] == 1 and m["train/skipped_steps"] == 1
    assert m["train/loss_scale"] == 2.0 ** 15  # backed off
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the step was skipped
    m = t.update(t.estimate(batch, rewards))  # recovers: a finite step at the smaller scale
    assert m["optimizer_steps"] == 1 and m["skipped_nonfinite"] == 0 and m["train/skipped_steps"] == 0
    assert m["train/loss_scale"] == 2.0 ** 15 and math.isfinite(m["grad_norm"])
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_float16_gradients_are_unscaled_before_the_norm_and_clipping(tiny_model, tokenizer):
    """The scaled backward's gradients, unscaled, are the unscaled float16 backward's (the
    gradient norm is the true one, so train.grad_clip clips what it would without scaling)."""
    batch, rewards = _batch(tiny_model, tokenizer)
    fn = rldsl.compile(rldsl.loads(SPEC, "t.rl"), compile=False)
    grads, norms = [], []
    for scaled in (True, False):
        model = copy.deepcopy(tiny_model)
        t = Trainer(fn, model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), skip_zero_advantage=False,
                    autocast_dtype=torch.float16, grad_clip=0.0, loss_scaler=LossScaler() if scaled else None)
        norms.append(t.update(t.estimate(batch, rewards))["grad_norm"])
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert norms[0] > 0 and norms[0] == pytest.approx(norms[1], rel=1e-2)
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 1e-2


def test_loss_scale_grows_after_growth_interval_finite_steps_and_backs_off_on_overflow():
    s = LossScaler(init_scale=8.0, growth_interval=2)
    assert s.update(True) and s.scale == 8.0
    assert s.update(True) and s.scale == 16.0  # 2 finite steps in a row: x2
    assert not s.update(False) and s.scale == 8.0 and s.good_steps == 0  # overflow: x0.5, count restarts
    assert s.update(True) and s.scale == 8.0
    assert s.take_skipped() == 1 and s.take_skipped() == 0
    s2 = LossScaler()
    s2.load_state_dict(s.state_dict())
    assert (s2.scale, s2.good_steps) == (8.0, 1)


def test_fsdp_ranks_compute_in_the_engines_precision():
    from rldsl.runtime.workers.fsdp_rank import param_dtype
    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def dtype(device, *sets):
        return param_dtype(load_config(None, list(sets)), device)

    assert dtype(cpu) is None and dtype(cuda) == torch.bfloat16
    assert dtype(cpu, "model.dtype=float16") == torch.float16 == dtype(cuda, "model.dtype=float16")
    assert dtype(cpu, "model.dtype=bfloat16") == torch.bfloat16
    assert dtype(cuda, "distributed.mixed_precision=off") is None
    assert dtype(cpu, "distributed.mixed_precision=bf16") == torch.bfloat16


def test_float16_with_bf16_ranks_is_refused_from_the_config():
    from rldsl.runtime.errors import ConfigError
    from rldsl.runtime.resolve import check_settings
    with pytest.raises(ConfigError, match="model.dtype=float16 with distributed.mixed_precision=bf16") as e:
        check_settings(rldsl.load("grpo"), load_config(None, ["model.dtype=float16", "distributed.mixed_precision=bf16"]))
    assert e.value.exit_code == 2


@pytest.mark.slow
def test_float16_checkpoints_keep_the_loss_scale_and_a_resume_reads_it(model_dir, tmp_path):
    """The loss scale (and its count of finite steps) is in each checkpoint of a float16 run and
    a resumed trainer starts from it, not from 2^16 (run/checkpointing.py, workers/local_trainers.py)."""
    from rldsl.runtime.records.checkpoint import load_checkpoint
    from rldsl.runtime.run import loop
    from rldsl.runtime.workers.local_trainers import LocalTrainers
    from small_run import small_run, steps_of
    cfg = small_run(model_dir, tmp_path / "run", "train.steps=1", "checkpoint.every=1", "model.dtype=float16",
                    "train.skip_zero_advantage=false")
    run = loop.train("grpo", cfg)
    (rec,) = steps_of(run)
    c = load_checkpoint(run / "checkpoints" / "step-1")
    assert c.extra["loss_scale"] == {"scale": rec["train/loss_scale"], "good_steps": rec["optimizer_steps"]}
    c.extra["loss_scale"] = {"scale": 1024.0, "good_steps": 7}  # what a run whose scale backed off saved
    trainers = LocalTrainers.from_config(cfg, rldsl.compile(rldsl.load("grpo"), compile=False),
                                         master_policy(cfg, model_dir, "cpu"))
    trainers.load_checkpoint(c)
    assert trainers.trainer.loss_scaler.state_dict() == {"scale": 1024.0, "good_steps": 7}


class _Lines:
    """A logger's print, kept (run/schedule.py reports through ``logger.print``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def print(self, text: str, **kwargs) -> None:
        self.lines.append(text)


def test_steps_whose_every_update_overflowed_are_reported_and_a_run_of_only_them_fails():
    """issue 57: a float16 run whose every update overflowed exited 0 with nothing on the console.
    A step trained nothing for overflow when the loss scaler skipped its updates and no optimizer
    step was taken; some such steps end the run with a warning naming how many, all of them with
    NothingTrained (exit 1)."""
    from rldsl.runtime.errors import NothingTrained
    from rldsl.runtime.run.schedule import overflowed_step, report_overflow

    assert overflowed_step({"optimizer_steps": 0.0, "train/skipped_steps": 2.0})
    assert not overflowed_step({"optimizer_steps": 1.0, "train/skipped_steps": 1.0})  # one went through
    assert not overflowed_step({"optimizer_steps": 0.0, "skipped_zero_adv": 1.0})  # nothing to learn: not overflow
    assert not overflowed_step({"optimizer_steps": 0.0})  # float32/bfloat16: no loss scaler
    out = _Lines()
    report_overflow(out, 0, 5, 65536.0)
    assert out.lines == []
    report_overflow(out, 2, 5, 16384.0)
    assert out.lines == ["warning: 2 of 5 steps trained nothing -- float16: every update's scaled gradient "
                         "overflowed (inf/nan) and was skipped; the loss scale backed off to 16384 "
                         "(train/skipped_steps, train/loss_scale)"]
    with pytest.raises(NothingTrained, match=r"the run trained nothing: in each of its 5 step\(s\) float16: .*"
                                             r"backed off to 0.5 .*model.dtype=bfloat16") as e:
        report_overflow(out, 5, 5, 0.5)
    assert e.value.exit_code == 1


@pytest.mark.slow
def test_a_float16_run_whose_every_update_overflows_exits_1_saying_so(model_dir, tmp_path, monkeypatch):
    """A loss scale no float can hold (the scaled loss is inf): every update of every step
    overflows, is skipped, and the run ends with exit 1 and the sentence, its records written."""
    from typer.testing import CliRunner
    from rldsl.cli import app
    from rldsl.runtime.train import parts
    from small_run import steps_of

    monkeypatch.setattr(parts, "loss_scaler", lambda dtype: LossScaler(init_scale=1e300) if dtype == torch.float16
                        else None)
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", "grpo", "--model", str(model_dir), "--out", str(out), "--set",
                                   "model.dtype=float16", "--set", "train.steps=2", "--set", "rollout.n=4",
                                   "--set", "rollout.prompts_per_step=2", "--set", "eval.every=0", "--set",
                                   "log.progress=false", "--set", "reward.name=reward_helpers:parity",
                                   "--set", "train.skip_zero_advantage=false"])
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert "the run trained nothing: in each of its 2 step(s) float16" in text
    assert "warning: step 1 trained nothing: float16" in text and "warning: step 2 trained nothing" in text
    records = steps_of(out)
    assert [r["optimizer_steps"] for r in records] == [0, 0] and all(r["train/skipped_steps"] >= 1 for r in records)
