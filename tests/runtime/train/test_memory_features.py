"""Gradient checkpointing gives the same gradients; bf16 (autocast, fp32 master weights and
optimizer state) runs on CPU and trains."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import rldsl
from rldsl.runtime.run import loop
from rldsl.runtime.config import load_config
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.models.loading import enable_gradient_checkpointing
from rldsl.runtime.train.trainer import Trainer

SPEC = """algorithm t
  baseline      group_mean
  objective     ppo
  trust_region  clip(low=0.2, high=0.2)
  aggregation   token_mean
"""


def _update(model, batch, rewards, **kw):
    fn = rldsl.compile(rldsl.loads(SPEC, "t.rl"), compile=False)
    t = Trainer(fn, model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                skip_zero_advantage=False, **kw)
    t.update(t.estimate(batch, rewards))
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_gradient_checkpointing_same_gradients(tiny_model, tokenizer) -> None:
    batch = HFEngine(tiny_model, tokenizer).generate(
        ["1+2=", "33+44="], SamplingParams(n=4, temperature=1.5, max_new_tokens=6, seed=0))
    rewards = torch.tensor([1.0, 0.0] * 4)
    plain = copy.deepcopy(tiny_model)
    ckpt = copy.deepcopy(tiny_model)
    enable_gradient_checkpointing(ckpt)
    assert any(getattr(m, "gradient_checkpointing", False) for m in ckpt.modules())
    a, b = _update(plain, batch, rewards), _update(ckpt, batch, rewards)
    assert len(a) == len(b) > 0 and any(float(g.abs().max()) > 0 for g in a)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, atol=1e-6, rtol=0)


def test_logits_chunk_shrinks_under_checkpointing_and_leaves_the_gradients(tiny_model, tokenizer) -> None:
    """train.logits_chunk: 1024 by default, 256 with gradient checkpointing, a set value wins;
    the LM head's chunk size does not change the update (here 3 tokens per chunk)."""
    from rldsl.runtime.train.parts import logits_chunk
    assert logits_chunk(load_config(None, [])) == 1024
    assert logits_chunk(load_config(None, ["train.gradient_checkpointing=true"])) == 256
    assert logits_chunk(load_config(None, ["distributed.activation_checkpointing=true"])) == 256
    assert logits_chunk(load_config(None, ["train.gradient_checkpointing=true", "train.logits_chunk=64"])) == 64
    fn = rldsl.compile(rldsl.loads(SPEC, "t.rl"), compile=False)
    cfg = load_config(None, ["train.gradient_checkpointing=true"])
    assert Trainer.from_config(cfg, fn, copy.deepcopy(tiny_model)).logprob_chunk == 256
    batch = HFEngine(tiny_model, tokenizer).generate(
        ["1+2=", "33+44="], SamplingParams(n=4, temperature=1.5, max_new_tokens=6, seed=0))
    rewards = torch.tensor([1.0, 0.0] * 4)
    a = _update(copy.deepcopy(tiny_model), batch, rewards)
    b = _update(copy.deepcopy(tiny_model), batch, rewards, logprob_chunk=3)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, atol=1e-6, rtol=0)


def test_bf16_autocast_keeps_fp32_master_weights(tiny_model, tokenizer) -> None:
    batch = HFEngine(tiny_model, tokenizer).generate(
        ["1+2=", "33+44="], SamplingParams(n=4, temperature=1.5, max_new_tokens=6, seed=0))
    rewards = torch.tensor([1.0, 0.0] * 4)
    ref = _update(copy.deepcopy(tiny_model), batch, rewards)
    model = copy.deepcopy(tiny_model)
    grads = _update(model, batch, rewards, autocast_dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(g.dtype == torch.float32 for g in grads)
    # bf16 compute: close to the fp32 gradient, but not equal to it (autocast was on)
    num = sum(float((g - r).norm() ** 2) for g, r in zip(grads, ref)) ** 0.5
    den = sum(float(r.norm() ** 2) for r in ref) ** 0.5
    assert 0 < num / den < 0.1


@pytest.mark.slow
def test_bf16_gradient_checkpointed_micro_batched_run_on_cpu(model_dir, tmp_path) -> None:
    cfg = load_config(None, [f"model.path={model_dir}", f"out={tmp_path}", "model.dtype=bfloat16",
                             "train.gradient_checkpointing=true", "train.max_tokens_per_microbatch=40",
                             "train.steps=2", "rollout.prompts_per_step=4", "rollout.n=4",
                             "eval.every=0", "data.eval_size=4", "log.progress=false"])
    run = loop.train("grpo", cfg)
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)


def test_gradient_checkpointing_forwards_ask_for_no_cache(tiny_model, tokenizer) -> None:
    """Under gradient checkpointing a training forward asks for no KV cache: the shared-prompt
    forward (which runs through a cache) is not tried, so transformers never turns a cache off
    with its "Caching is incompatible with gradient checkpointing" warning; same logprobs."""
    from rldsl.runtime.models.loading import backbone
    from rldsl.runtime.train.logprobs import Forward, token_logprobs
    batch = HFEngine(tiny_model, tokenizer).generate(["1+2=", "33+44="], SamplingParams(n=4, temperature=1.5,
                                                                                        max_new_tokens=6, seed=0))
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    Tr = batch.response_ids.shape[1]
    model = copy.deepcopy(tiny_model).train()
    want = token_logprobs(model, Forward(ids, mask, Tr, group_size=4)).logprobs
    enable_gradient_checkpointing(model)
    asked = []
    backbone(model).register_forward_pre_hook(lambda m, a, kw: asked.append(kw.get("use_cache")), with_kwargs=True)
    got = token_logprobs(model, Forward(ids, mask, Tr, group_size=4)).logprobs
    assert asked and not any(asked), asked
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
