"""Partial rollouts (rollout.partial): a batch generated in segments, newer weights loaded
between two; each token carries the version that sampled it and that version's logprob; the
continuation is token in, token out; runs record token-level staleness and resume."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from rldsl.runtime.run import loop
from rldsl.runtime.batch import model_inputs
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.records.metrics import read_metrics
from rldsl.runtime.rollout.partial import generate_in_segments, segment_seed
from small_run import small_run

PROMPTS = ["1+2=", "33+44="]


def _recomputed(model, batch) -> torch.Tensor:
    """[B, Tr] log p(token) of the response tokens under ``model`` (temperature 1)."""
    ids, attn, pos = model_inputs(batch)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    Tp = batch.prompt_ids.shape[1]
    return torch.log_softmax(logits[:, Tp - 1:-1], -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)


def test_segments_switch_versions_and_keep_each_versions_logprobs(tokenizer, tiny_model_factory) -> None:
    old = tiny_model_factory(tokenizer, seed=0)
    new = tiny_model_factory(tokenizer, seed=1)
    engine = HFEngine(copy.deepcopy(old), tokenizer)
    calls = []

    def refresh() -> int:  # the trainer publishes version 1 while the first segment is generated
        calls.append(len(calls))
        if len(calls) == 2:
            engine.update_weights(new.state_dict().items())
        return 0 if len(calls) == 1 else 1

    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)
    batch = generate_in_segments(engine, PROMPTS, params, 3, refresh)
    mask = batch.response_mask.bool()
    tv = batch.token_versions
    assert (tv[~mask] == -1).all()
    pos = torch.arange(tv.shape[1]).expand_as(tv)
    assert ((tv == 0) == (mask & (pos < 3))).all() and ((tv == 1) == (mask & (pos >= 3))).all()
    assert bool((tv == 1).any()), "no row ran past the first segment"
    # the behaviour logprobs: each token's own version's, recomputed on the whole sequence
    assert torch.allclose(batch.logprobs[tv == 0], _recomputed(old, batch)[tv == 0], atol=1e-5)
    assert torch.allclose(batch.logprobs[tv == 1], _recomputed(new, batch)[tv == 1], atol=1e-5)
    assert not torch.allclose(_recomputed(old, batch)[tv == 1], batch.logprobs[tv == 1], atol=1e-3)
    # token in, token out: the second segment is exactly what generate_ids samples from those ids
    rows = [b for b in range(len(batch)) if int(mask[b].sum()) > 3]
    again = engine.generate_ids([batch.prompt_ids[b][batch.prompt_mask[b].bool()].tolist()
                                 + batch.response_ids[b, :3].tolist() for b in rows],
                                SamplingParams(n=1, temperature=1.0, max_new_tokens=3, seed=segment_seed(5, 1)))
    for r, b in enumerate(rows):
        n = int(again.response_mask[r].sum())
        assert batch.response_ids[b, 3:3 + n].tolist() == again.response_ids[r, :n].tolist()
    assert batch.completions == tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
    assert all(f in ("stop", "length") for f in batch.finish_reason)


def _config(model_dir: Path, out: Path, *extra: str):
    """5 steps, 8 tokens an answer (room for segments), lr 0.01 (versions that differ)."""
    return small_run(model_dir, out, "train.steps=5", "data.eval_size=4", "eval.samples=0",
                     "rollout.max_new_tokens=8", "train.lr=0.01", *extra)


@pytest.mark.slow
def test_a_partial_run_logs_token_level_staleness(model_dir, tmp_path) -> None:
    run = loop.train("grpo_tis", _config(model_dir, tmp_path / "p", "rollout.max_staleness=2",
                                         "rollout.partial=true", "rollout.partial_tokens=2"))
    recs = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    for r in recs:
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 2
        assert math.isfinite(r["loss"])
    assert recs[0]["async/staleness_max"] == 0  # the first batch: the starting weights, its own step


def test_partial_needs_an_asynchronous_run(model_dir, tmp_path) -> None:
    with pytest.raises(ConfigError, match="rollout.max_staleness >= 1"):
        loop.train("grpo", _config(model_dir, tmp_path / "r", "rollout.partial=true"))


@pytest.mark.slow
def test_a_partial_run_killed_and_resumed_loses_nothing(model_dir, tmp_path) -> None:
    over = ("rollout.max_staleness=1", "rollout.partial=true", "rollout.partial_tokens=2", "checkpoint.every=2")
    cut = loop.train("grpo_tis", _config(model_dir, tmp_path / "cut", *over), stop_after=3)
    assert [r["step"] for r in read_metrics(cut / "metrics.jsonl") if "reward_mean" in r] == [1, 2, 3]
    resumed = loop.train("grpo_tis", resume=cut)
    recs = [r for r in read_metrics(resumed / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) and r["async/staleness_max"] <= 1 for r in recs)
