"""End-to-end runtime semantics through the public config: what a user's run trains on.

- the trainer's logprobs equal the engine's at every sampling temperature (one process and
  two FSDP ranks): ``rollout_logprob_diff`` <= 1e-5;
- tiny local configs of eight architectures train 2 steps from ``--model DIR`` with the
  same agreement;
- generation stops on every EOS id of a model's ``generation_config``;
- a model whose context is shorter than prompt + ``max_new_tokens`` is clipped with a
  warning, or refused before the first step, never an ``IndexError`` mid-step;
- a ``--model`` run gets the peers' optimizer defaults, not the toy's.

Each case failed before the runtime plumbing landed (the training-side temperature, the
engines' stop ids, the context clip, model-run defaults).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rldsl.runtime.records.metrics import read_metrics
from tiny_archs import ARCHS, save
from small_run import small_run
from local_ray import local_ray

TEMPERATURES = (0.5, 0.7, 1.0, 1.3)


def _config(model_dir: Path, out: Path, **over):
    return small_run(model_dir, out, "train.steps=2", "data.eval_size=0",
                     "train.minibatches=2",  # off-policy: the old logprobs come from a separate forward
                     "rollout.max_new_tokens=6", **over)


def _diffs(run: Path) -> list[float]:
    recs = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2]
    return [r["rollout_logprob_diff"] for r in recs]


@pytest.mark.slow
@pytest.mark.parametrize("T", TEMPERATURES)
def test_trainer_logprobs_equal_the_engines_at_the_rollout_temperature(T, model_dir, tmp_path):
    from rldsl.runtime.run import loop
    run = loop.train("lite_ppo", _config(model_dir, tmp_path / "run", **{"rollout.temperature": T}))
    assert max(_diffs(run)) <= 1e-5


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the distributed cases (short temp path: Ray's socket names)."""
    pytest.importorskip("ray")
    with local_ray(4):
        yield


@pytest.mark.slow
@pytest.mark.parametrize("T", (0.7, 1.0))
def test_two_trainer_ranks_logprobs_equal_the_engines(T, ray_cluster, model_dir, tmp_path):
    from rldsl.runtime.run import loop
    run = loop.train("lite_ppo", _config(model_dir, tmp_path / "run", **{
        "rollout.temperature": T, "distributed.trainers": 2, "distributed.rollout_workers": 1,
        "distributed.sync_timeout": 120, "distributed.collective_timeout": 120}))
    assert max(_diffs(run)) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("T", (1.0, 0.7))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_trains_from_a_model_folder(arch, T, tokenizer, tmp_path):
    from rldsl.runtime.run import loop
    model_dir = save(arch, tokenizer, tmp_path / arch)
    run = loop.train("grpo", _config(model_dir, tmp_path / "run", **{"rollout.temperature": T}))
    diffs = _diffs(run)
    assert all(math.isfinite(d) for d in diffs)
    assert max(diffs) <= 1e-5, (arch, diffs)


def test_generation_stops_on_every_eos_id_of_the_generation_config(tiny_model, tokenizer):
    from rldsl.runtime.rollout.engines.hf import HFEngine
    from rldsl.runtime.rollout.engines.base import SamplingParams
    stop = tokenizer.convert_tokens_to_ids("5")  # a second EOS, as Qwen models have several
    tiny_model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    with torch.no_grad():  # make "5" likely so that rows hit it
        tiny_model.lm_head.weight[stop] *= 0
        tiny_model.lm_head.bias = None
    batch = HFEngine(tiny_model, tokenizer).generate(
        ["1+2=", "33+44="], SamplingParams(n=8, temperature=1.0, max_new_tokens=12, seed=0))
    eos = {tokenizer.eos_token_id, stop}
    hit = 0
    for b in range(len(batch)):
        ids = batch.response_ids[b][batch.response_mask[b].bool()].tolist()
        first = next((i for i, t in enumerate(ids) if t in eos), None)
        if first is not None:
            hit += 1
            assert first == len(ids) - 1, "generation went on after an EOS id"
            assert batch.finish_reason[b] == "stop"
    assert hit > 0


@pytest.mark.slow
def test_short_context_model_with_long_max_new_tokens(tokenizer, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    from rldsl.runtime.run import loop
    from rldsl.runtime.errors import ConfigError
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2,
                                       n_positions=16, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 0  # long answers: they reach the limit
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    cfg = _config(tmp_path / "m", tmp_path / "run", **{"rollout.max_new_tokens": 1024})
    try:
        run = loop.train("grpo", cfg)
    except ConfigError as exc:  # refused before the first step, naming the limit
        assert "max_new_tokens" in str(exc) and "16" in str(exc)
        assert not (tmp_path / "run" / "metrics.jsonl").exists() or not any(
            "reward_mean" in r for r in read_metrics(tmp_path / "run" / "metrics.jsonl"))
        return
    recs = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2]
    out = capsys.readouterr().out  # clipped, with a note at the start, and config.json says so
    assert "exceeds the model's context of 16 positions: generating at most 9 new tokens" in out
    assert json.loads((run / "config.json").read_text())["rollout"]["max_new_tokens"] == 9


def test_model_run_gets_the_peers_optimizer_defaults(model_dir):
    from rldsl.runtime.cli import build_run_config
    _, cfg = build_run_config("grpo", flags={"model.path": str(model_dir)})
    assert cfg.train.lr == 1e-6  # TRL GRPOConfig.learning_rate; verl actor optim lr
    assert tuple(cfg.train.betas) == (0.9, 0.999)  # torch AdamW / TRL / verl
    _, toy = build_run_config("grpo")
    assert toy.train.lr == 3e-4 and tuple(toy.train.betas) == (0.9, 0.99)  # the toy keeps its tuning
    _, mine = build_run_config("grpo", flags={"model.path": str(model_dir)},
                               overrides=["train.lr=5e-5", "train.betas=[0.9, 0.95]"])
    assert mine.train.lr == 5e-5 and tuple(mine.train.betas) == (0.9, 0.95)  # set: kept
