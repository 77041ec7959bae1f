"""The tool-use demo end to end: episodes on the tool model (token-in/token-out, masks, the
engine's logprobs), tool-call metrics, and a short `data.task=calculator` run."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rldsl.runtime.run import loop
from rldsl.runtime.batch import model_inputs
from rldsl.runtime.config import load_config
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.rollout.episodes.env import ToolEnv
from rldsl.runtime.rollout.episodes.runner import run_episodes
from rldsl.runtime.records.metrics import TOOL_CALLS_PER_EPISODE, TOOL_CALLS_WELL_FORMED, read_metrics
from rldsl.runtime.rollout.tool_metrics import tool_call_metrics
from rldsl.runtime.toy.calculator import SumTask, calculator


@pytest.mark.slow
def test_episodes_are_token_in_token_out(tool_model) -> None:
    model = LlamaForCausalLM.from_pretrained(tool_model).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(tool_model)
    engine = HFEngine(model, tok)
    rows = [{"prompt": e.prompt, "answer": e.answer} for e in SumTask(num_train=20, num_validation=1).train_examples()[:4]]
    envs = [ToolEnv([calculator]) for _ in range(len(rows) * 2)]
    batch = run_episodes(engine, tok, rows, envs, SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=0),
                         max_turns=3, context=128)
    assert batch.response_attention is not None and len(batch.episodes) == 8
    # the loss mask sits inside the attention; tool + template tokens are attended, not trained
    assert bool((batch.response_mask <= batch.response_attention).all())
    calls = [i for i, ep in enumerate(batch.episodes) if any(m["role"] == "tool" for m in ep.messages)]
    assert calls, "the warm-started model made no tool call"
    eos = tok.eos_token_id
    for i in calls:
        ep = batch.episodes[i].messages
        n = int(batch.response_attention[i].sum())
        ids = batch.response_ids[i, :n]
        model_ids = ids[batch.response_mask[i, :n].bool()].tolist()
        env_ids = ids[~batch.response_mask[i, :n].bool()].tolist()
        said = [m["content"] for m in ep if m["role"] == "assistant"]
        # the model's tokens are its messages (each closed by EOS) exactly as sampled
        turns, cur = [], []
        for t in model_ids:
            cur.append(t)
            if t == eos:
                turns.append(cur)
                cur = []
        turns += [cur] if cur else []
        # (a tools episode's message is the text its parser read: special tokens kept, the EOS that
        # ended the turn left out -- docs/runtime.md)
        assert [tok.decode(t[:-1] if t[-1] == eos else t, skip_special_tokens=False) for t in turns] == said
        # the environment's tokens are the template's delta: tool result in a user turn
        tool_text = tok.decode(env_ids, skip_special_tokens=False)
        result = next(m["content"] for m in ep if m["role"] == "tool")
        assert f"<tool_response>\n{result}\n</tool_response>" in tool_text
        assert model_ids.count(eos) in (len(said), len(said) - 1)  # the last turn may be cut off
        if batch.finish_reason[i] == "stop":  # prompt + response = the template's rendering
            whole = tok.decode(torch.cat([batch.prompt_ids[i][batch.prompt_mask[i].bool()], ids]).tolist())
            assert whole + "\n" == tok.apply_chat_template(ep, tools=[calculator], tokenize=False)
    # the trainer's recomputed logprobs of the model's tokens equal the engine's (float32, T=1)
    ids, attn, pos = model_inputs(batch)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    Tp = batch.prompt_ids.shape[1]
    lp = torch.log_softmax(logits[:, Tp - 1:-1], -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    m = batch.response_mask.bool()
    assert torch.allclose(lp[m], batch.logprobs[m], atol=1e-4)
    metrics = tool_call_metrics(batch)
    assert metrics[TOOL_CALLS_PER_EPISODE] > 0 and 0 <= metrics[TOOL_CALLS_WELL_FORMED] <= 1


@pytest.mark.slow
def test_calculator_task_run_end_to_end(tool_model, tmp_path) -> None:
    cfg = load_config(None, [f"model.path={tool_model}", f"out={tmp_path / 'run'}", "data.task=calculator",
                             "rollout.prompts_per_step=4", "rollout.n=4", "train.steps=2", "eval.every=2",
                             "eval.samples=1", "data.eval_size=8", "checkpoint.every=0", "log.progress=false"])
    run = loop.train("lite_ppo", cfg)
    saved = (run / "config.json").read_text()
    assert "rldsl.runtime.toy.calculator:calculator" in saved  # the task filled in its tool
    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r[TOOL_CALLS_PER_EPISODE] > 0 for r in steps)
    evals = [r for r in records if "eval/greedy_acc" in r]
    assert evals and all("eval/" + TOOL_CALLS_WELL_FORMED in r for r in evals)
    assert all(math.isfinite(r["loss"]) for r in steps if r.get("optimizer_steps"))
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["messages"][0] == {"role": "user", "content": s["prompt"].split("user\n")[1].split("<")[0],
                                                "trained": False}
                           for s in samples)
    assert any(m["role"] == "tool" for s in samples for m in s["messages"])


def _env_config(tool_model: Path, out: Path, *extra: str):
    return load_config(None, [f"model.path={tool_model}", f"out={out}", "data.task=calculator",
                              "rollout.env=episode_helpers:CalcEnv", "reward.name=env",
                              "rollout.prompts_per_step=2", "rollout.n=4", "train.steps=2", "eval.every=0",
                              "eval.samples=0", "data.eval_size=4", "checkpoint.every=0", "log.progress=false",
                              "log.samples_per_step=2", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one process", "async K=1", "ray rollout worker", "lora + micro-batches"])
def test_an_environment_class_trains_on_its_own_reward(tool_model, tmp_path, mode) -> None:
    """--env episode_helpers:CalcEnv with --reward env: the environment's end-of-episode reward is
    what the run trains on, in one process, asynchronously and on a Ray rollout actor; samples.jsonl
    shows the episode with its trained turns."""
    extra = {"one process": (), "async K=1": ("rollout.max_staleness=1", "correction=none"),
             "ray rollout worker": ("distributed.rollout_workers=1",),
             "lora + micro-batches": ("model.lora.rank=4", "train.max_tokens_per_microbatch=64")}[mode]
    extra = tuple(e for e in extra if not e.startswith("correction"))
    run = loop.train("grpo_tis", _env_config(tool_model, tmp_path / "run", *extra))
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["reward_errors"] == 0 and 0 <= r["reward_mean"] <= 1 for r in steps)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["env_reward"] in (0.0, 1.0) and s["env_reward"] == s["reward"]
                           for s in samples if s["finish_reason"] == "stop")
    for s in samples:
        assert all(m["trained"] == (m["role"] == "assistant") for m in s["messages"])
        assert s["trained_tokens"] == s["response_length"] and s["environment_tokens"] >= 0
