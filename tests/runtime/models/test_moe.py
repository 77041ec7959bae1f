"""Mixture-of-experts policies: the HF engine records each token's experts, the trainer's
forwards replay them (runtime/models/moe.py, docs/moe.md), on tiny random Qwen3-MoE and Mixtral
models (tests/fixtures/moe_model.py)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rldsl.runtime.config import RunConfig
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.resolve import check_routing_replay
from rldsl.runtime.batch import RolloutBatch, model_inputs
from rldsl.runtime.models import moe
from rldsl.runtime.models.loading import folder_is_moe, load_tokenizer
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs
from rldsl.runtime.train.microbatch import trim

from moe_helpers import check_episode_routing, forced_logprobs, move, routed_logprobs

ARCHS = ["qwen3_moe", "mixtral"]
PROMPTS = ["hello there", "What is the weather in Paris today?", "1+2=", "Tell me the weather in Rome, Cairo"]


def _rollout(folder) -> tuple[torch.nn.Module, RolloutBatch]:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    engine = HFEngine(copy.deepcopy(model), load_tokenizer(folder))
    batch = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=10, temperature=1.0, seed=0, top_p=1.0))
    return model, batch


def test_config_json_says_moe(moe_model, real_model):
    assert folder_is_moe(moe_model("qwen3_moe")) and folder_is_moe(moe_model("mixtral"))
    assert folder_is_moe(real_model("qwen2.5")) is False


def test_dense_model_with_replay_is_refused_before_it_loads(real_model, moe_model, tmp_path, monkeypatch):
    """rollout.routing_replay=true on a dense model: exit 2, a clear message, before any model loads
    (config.json read); on a MoE model the same command gets past the check."""
    from typer.testing import CliRunner

    from rldsl.cli import app
    from rldsl.runtime.models import loading

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(loading, "load_policy", no_load)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    args = ["run", "grpo", "--data", str(data), "--out", str(tmp_path / "r"), "--set", "rollout.routing_replay=true",
            "--set", "log.progress=false", "--model"]
    res = CliRunner().invoke(app, args + [str(real_model("qwen2.5"))])
    assert res.exit_code == 2, res.output
    assert "rollout.routing_replay" in res.output and "dense" in res.output and "Traceback" not in res.output
    assert check_routing_replay(RunConfig.model_validate({"rollout": {"routing_replay": True}}),
                                moe_model("mixtral")) is None
    assert check_routing_replay(RunConfig.model_validate({"rollout": {"routing_replay": True, "engine": "vllm"}}),
                                moe_model("mixtral")) is None
    cfg = RunConfig.model_validate({"rollout": {"routing_replay": True, "engine": "vllm",
                                                "vllm": {"engine_kwargs": {"enable_prefix_caching": True}}}})
    with pytest.raises(ConfigError, match="prefix caching"):
        check_routing_replay(cfg, moe_model("mixtral"))
    for over in ({"tools": "real_tools:get_weather"}, {"env": "episode_helpers:Nudge"},
                 {"agent": "agent_helpers:calc_agent"}, {"engine": "vllm", "tools": "real_tools:get_weather"},
                 {"engine": "vllm", "env": "episode_helpers:Nudge"},
                 {"engine": "vllm", "agent": "agent_helpers:calc_agent"}):  # episodes and agents on both engines
        assert check_routing_replay(RunConfig.model_validate({"rollout": {"routing_replay": True, **over}}),
                                    moe_model("mixtral")) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_routing_is_the_engines(moe_model, arch):
    """The engine records every fed token (prompt and response, but each response's last token) and
    padding stays -1; at the engine's weights the trainer routes as recorded and replay is
    bit-identical to the plain forward."""
    model, batch = _rollout(moe_model(arch))
    ids, attn, _ = model_inputs(batch)
    Y = len(moe.routers(model))
    r = batch.routed_experts
    assert r is not None and r.shape == (*ids.shape, Y, 2) and r.dtype == torch.int16
    fed = attn.bool().clone()
    lengths = batch.response_mask.sum(1)
    Tp = batch.prompt_ids.shape[1]
    fed[torch.arange(len(batch)), Tp + lengths - 1] = False  # the last token is never fed
    assert bool((r >= 0).all(-1).all(-1).eq(fed).all())
    plain, metrics = routed_logprobs(model, batch, replay=False)
    replayed, replay_metrics = routed_logprobs(model, batch, replay=True)
    valid = batch.response_mask.bool()
    assert torch.equal(plain[valid], replayed[valid])
    assert metrics["moe/routing_mismatch"] == 0.0 == replay_metrics["moe/routing_mismatch"]
    assert (plain - batch.logprobs)[valid].abs().max() < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_after_the_weights_moved(moe_model, arch):
    """After an Adam step the routing drifts; replayed (padded, packed, micro-batches) = the rows
    each run alone under the recorded experts to 1e-6, the forward's mismatch 0."""
    model, batch = _rollout(moe_model(arch))
    move(model, batch)
    plain, before = routed_logprobs(model, batch, replay=False)
    assert before["moe/routing_mismatch"] > 0.1
    replayed, after = routed_logprobs(model, batch, replay=True)
    assert after["moe/routing_mismatch"] == 0.0 and after["moe/router_drift"] > 0.1  # the router would move
    valid = batch.response_mask.bool()
    forced = forced_logprobs(model, batch)
    assert (replayed - forced)[valid].abs().max() < 1e-6
    assert (plain - forced)[valid].abs().max() > 1e-3  # replay changed them
    packed, _ = routed_logprobs(model, batch, replay=True, packing=True)
    assert (packed - forced)[valid].abs().max() < 1e-6
    # micro-batches: rows selected, trimmed (columns dropped on both sides), and stacked back
    for rows in (torch.tensor([1, 5]), torch.tensor([6, 0, 3])):
        sub, tr = trim(batch.select(rows))
        lp, _ = routed_logprobs(model, sub, replay=True)
        assert (lp - forced[rows, :tr])[sub.response_mask.bool()].abs().max() < 1e-6
    halves = RolloutBatch.concat([batch.select(torch.arange(0, 4)), trim(batch.select(torch.arange(4, 8)))[0]],
                                 pad_id=0)
    lp, _ = routed_logprobs(model, halves, replay=True)
    assert (lp - forced)[valid].abs().max() < 1e-6


def test_checkpointed_queue_keeps_the_routing(moe_model):
    """A rollout held in an asynchronous run's queue goes through a checkpoint with its routing."""
    from rldsl.runtime.run.checkpointing import _batch_of, _plain_batch
    _, batch = _rollout(moe_model("mixtral"))
    back = _batch_of(_plain_batch(batch))
    assert torch.equal(back.routed_experts, batch.routed_experts)


def _run_moe(folder, out, replay: bool) -> list[dict]:
    from rldsl.runtime.config import load_config
    from rldsl.runtime.records.metrics import read_metrics
    from rldsl.runtime.run import loop
    cfg = load_config(None, [f"model.path={folder}", f"out={out}", "rollout.prompts_per_step=2", "rollout.n=4",
                             "rollout.max_new_tokens=8", "train.steps=3", "data.task=addition", "eval.every=0",
                             "checkpoint.every=0", "log.progress=false", "reward.name=reward_helpers:parity",
                             f"rollout.routing_replay={str(replay).lower()}", "train.lr=1e-2",
                             "rollout.max_staleness=1", "train.packing=true", "train.max_tokens_per_microbatch=48"])
    run = loop.train("grpo", cfg)
    return [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]


@pytest.mark.slow
def test_async_packed_run_with_and_without_replay(moe_model, tmp_path):
    """An asynchronous run (the batch of step s sampled by the policy of s - 1: the routers moved),
    packed, in token-budget micro-batches: without replay the trainer routes tokens elsewhere than
    the engine did; with it, nowhere (moe/routing_mismatch), the loads logged every step."""
    folder = moe_model("qwen3_moe")
    plain = _run_moe(folder, tmp_path / "plain", replay=False)
    replayed = _run_moe(folder, tmp_path / "replay", replay=True)
    for recs in (plain, replayed):
        assert [r["step"] for r in recs] == [1, 2, 3]
        assert all({"moe/routing_mismatch", "moe/expert_load_max", "moe/expert_load_cv"} <= set(r) for r in recs)
    assert max(r["moe/routing_mismatch"] for r in plain[1:]) > 0.1
    assert all(r["moe/routing_mismatch"] == 0.0 for r in replayed)


def _moe_config(folder, out, **over):
    from rldsl.runtime.config import load_config
    sets = [f"model.path={folder}", f"out={out}", "rollout.prompts_per_step=2", "rollout.n=4",
            "rollout.max_new_tokens=6", "train.steps=3", "data.task=addition", "eval.every=0", "data.eval_size=0",
            "checkpoint.every=0", "log.progress=false", "reward.name=reward_helpers:parity",
            "rollout.routing_replay=true", "train.lr=1e-2", "rollout.max_staleness=1"]
    return load_config(None, sets + [f"{k}={v}" for k, v in over.items()])


def _steps(run) -> list[dict]:
    from rldsl.runtime.records.metrics import read_metrics
    return [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]


@pytest.mark.slow
def test_lora_on_attention_of_a_moe_policy_trains_with_replay(moe_model, tmp_path):
    """LoRA adapters on the attention projections of a Mixtral policy: they train, the experts and
    routers stay, the replayed forwards route as the engine did."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from rldsl.runtime.run import loop
    folder = moe_model("mixtral")
    run = loop.train("grpo", _moe_config(folder, tmp_path / "run", **{
        "model.lora.rank": 4, "model.lora.target_modules": '["q_proj","k_proj","v_proj","o_proj"]',
        "checkpoint.every": 3}))
    recs = _steps(run)
    assert [r["step"] for r in recs] == [1, 2, 3] and any(r["optimizer_steps"] > 0 for r in recs)
    assert all(r["moe/routing_mismatch"] == 0.0 for r in recs)
    state = load_file(str(run / "checkpoints" / "step-3" / "policy" / "model.safetensors"))
    base = load_file(str(folder / "model.safetensors"))
    moved = [k for k in state if ".lora_B." in k and bool(state[k].abs().sum() > 0)]
    assert moved and all("self_attn" in k for k in moved)
    for k, v in state.items():
        plain = k.replace("base_model.model.", "").replace(".base_layer.", ".")
        if "lora" not in k and plain in base:
            assert torch.equal(v, base[plain]), k


@pytest.mark.slow
def test_lora_reference_forward_is_not_counted_as_the_policys_routing(moe_model, tmp_path):
    """With LoRA the reference is the policy with its adapters off (GRPO's KL reads it); its
    forward routes as the base model, so it must not count into the policy's moe/* metrics: in a
    synchronous run the policy routes every sampled token as the engine recorded (router_drift 0 at
    every step; it read 0.42 once the adapters had moved, when the reference forward was counted)."""
    from rldsl.runtime.run import loop
    run = loop.train("grpo", _moe_config(moe_model("qwen3_moe"), tmp_path / "run", **{
        "rollout.max_staleness": 0, "model.lora.rank": 4, "model.lora.target_modules": '["q_proj","v_proj"]'}))
    recs = _steps(run)
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["optimizer_steps"] > 0 for r in recs)
    assert all(r["moe/routing_mismatch"] == 0.0 == r["moe/router_drift"] for r in recs), recs
    assert all(r["kl"] > 0 for r in recs[1:])  # the reference forward ran, and the adapters moved


@pytest.mark.slow
def test_resumed_run_with_replay_equals_the_uninterrupted_one(moe_model, tmp_path):
    """An asynchronous run with replay and `router balance` (the routers' load-balancing loss, its
    value logged as moe/aux_loss) stopped after step 2 (its queued rollout, routing included, in the
    checkpoint) and resumed ends with the uninterrupted run's weights and metrics."""
    from safetensors.torch import load_file

    from rldsl.runtime.records import checkpoint as ckpt
    from rldsl.runtime.records.metrics import TIMED
    from rldsl.runtime.run import loop
    folder = moe_model("qwen3_moe")
    spec = tmp_path / "grpo_balanced.rl"  # GRPO with the routers' load-balancing loss
    spec.write_text("algorithm grpo_balanced\n  baseline group_mean\n  normalizer group_std(eps=1e-6)\n"
                    "  objective ppo\n  trust_region clip(low=0.2, high=0.2)\n  router balance(coef=0.01)\n")
    full = loop.train(str(spec), _moe_config(folder, tmp_path / "full", **{"checkpoint.every": 1}))
    cut = loop.train(str(spec), _moe_config(folder, tmp_path / "cut", **{"checkpoint.every": 1}), stop_after=2)
    assert ckpt.latest_checkpoint(cut).name == "step-2"
    loop.train(None, resume=cut)
    a, b = (load_file(str(r / "checkpoints" / "step-3" / "policy" / "model.safetensors")) for r in (full, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(TIMED)} for r in rs]  # noqa: E731
    assert strip(_steps(full)) == strip(_steps(cut))
    assert all(r["moe/aux_loss"] > 0 for r in _steps(full))


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_weights_load_back_into_a_moe_model(moe_model, arch, tmp_path):
    """save_pretrained writes a MoE's fused experts one tensor per expert (transformers 5's
    released layout); the checkpoint loader reads them back into the fused in-memory layout."""
    from rldsl.runtime.records.checkpoint import load_weights
    model = AutoModelForCausalLM.from_pretrained(moe_model(arch))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    model.save_pretrained(tmp_path / "saved")
    fresh = AutoModelForCausalLM.from_pretrained(moe_model(arch))
    load_weights(fresh, tmp_path / "saved")
    a, b = model.state_dict(), fresh.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ranks_resume_state_holds_a_full_weight_moe_checkpoint_under_the_fused_names(moe_model, tmp_path):
    """What the FSDP ranks load on resume (``read_full_state``) from a full-weight MoE checkpoint
    (its experts saved one tensor per expert): the model's own fused names, the saved weights
    exactly, the critic's too (the policy's were the checkpoint's per-expert keys, which the ranks'
    modules refused)."""
    from safetensors.torch import load_file

    from rldsl.runtime.records.checkpoint import load_checkpoint, save_checkpoint
    from rldsl.runtime.train.value_model import ValueModel
    from rldsl.runtime.workers.full_state import read_full_state
    folder = moe_model("qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    critic = ValueModel(model)  # the critic of a value-baseline spec: the MoE body, fused
    with torch.no_grad():
        critic.head.weight.fill_(0.5)
    save_checkpoint(tmp_path / "run", 1, policy=model, tokenizer=load_tokenizer(folder),
                    optimizer=torch.optim.AdamW(model.parameters()), scheduler=None, critic=critic)
    c = load_checkpoint(tmp_path / "run")
    assert any(".experts.0." in k for k in load_file(str(c.policy_path / "model.safetensors")))
    state = read_full_state(_moe_config(folder, tmp_path / "out"), str(folder), c)
    own = model.state_dict()
    assert state["policy"].keys() == own.keys() and all(torch.equal(state["policy"][k], own[k]) for k in own)
    own = critic.state_dict()
    assert state["critic"].keys() == own.keys() and all(torch.equal(state["critic"][k], own[k]) for k in own)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for the two-rank case (as tests/runtime/workers/test_ray.py's)."""
    import logging
    import shutil
    import tempfile
    ray = pytest.importorskip("ray")
    tmp = tempfile.mkdtemp(prefix="rldsl-ray-", dir="/tmp")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", _temp_dir=tmp, logging_level=logging.WARNING)
    yield
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_two_fsdp_trainer_ranks_with_replay_equal_one_process(ray_cluster, moe_model, tmp_path):
    """FSDP2 over 2 gloo trainer ranks (Ray actors; the driver's engine records the routing, the rollout
    travels to the ranks, each replays its rows) = the one-process run: rewards, losses, grad
    norms and the replayed forward's mismatch (0)."""
    import math

    from rldsl.runtime.run import loop
    folder = moe_model("qwen3_moe")
    common = {"train.minibatches": 2, "rollout.max_staleness": 0, "distributed.sync_timeout": 120,
              "distributed.collective_timeout": 120, "train.steps": 1}
    one = _steps(loop.train("grpo", _moe_config(folder, tmp_path / "one", **common)))
    two = _steps(loop.train("grpo", _moe_config(folder, tmp_path / "two", **common, **{
        "distributed.trainers": 2})))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1]
    for a, b in zip(one, two):
        assert a["reward_mean"] == b["reward_mean"]
        assert a["moe/routing_mismatch"] == 0.0 == b["moe/routing_mismatch"]
        for k in ("loss", "grad_norm"):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-5), (k, a[k], b[k])


@pytest.mark.slow
def test_full_weight_moe_on_two_fsdp_ranks_resumes_exactly(ray_cluster, moe_model, tmp_path):
    """A full-weight MoE run on 2 FSDP2 trainer ranks stopped after step 1 and resumed there ends
    with the uninterrupted run's weights and metrics. Its checkpoint holds the experts one tensor
    per expert (the released layout) where the ranks' modules hold them fused: the resume reads it
    through the loader the one-process resume uses (it failed on the per-expert keys)."""
    from safetensors.torch import load_file

    from rldsl.runtime.records import checkpoint as ckpt
    from rldsl.runtime.records.metrics import TIMED
    from rldsl.runtime.run import loop
    folder = moe_model("qwen3_moe")
    over = {"train.steps": 2, "checkpoint.every": 1, "rollout.max_staleness": 0, "distributed.trainers": 2,
            "distributed.sync_timeout": 120, "distributed.collective_timeout": 120}
    full = loop.train("grpo", _moe_config(folder, tmp_path / "full", **over))
    cut = loop.train("grpo", _moe_config(folder, tmp_path / "cut", **over), stop_after=1)
    assert ckpt.latest_checkpoint(cut).name == "step-1"
    saved = load_file(str(cut / "checkpoints" / "step-1" / "policy" / "model.safetensors"))
    assert any(".experts.0." in k for k in saved)  # the released layout, one tensor per expert
    loop.train(None, resume=cut)
    a, b = (load_file(str(r / "checkpoints" / "step-2" / "policy" / "model.safetensors")) for r in (full, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(TIMED)} for r in rs]  # noqa: E731
    assert [r["step"] for r in _steps(cut)] == [1, 2] and strip(_steps(full)) == strip(_steps(cut))


@pytest.mark.slow
def test_ray_rollout_worker_routing_is_replayed(ray_cluster, moe_model, tmp_path):
    """A rollout worker on a Ray actor (its own HF engine) records the routing; it comes back with
    the rollout and the trainer replays it: the replayed forward's mismatch is 0 while the router
    would have moved (asynchronous: each batch sampled one step behind)."""
    from rldsl.runtime.run import loop
    run = loop.train("grpo", _moe_config(moe_model("qwen3_moe"), tmp_path / "ray", **{
        "train.steps": 2, "distributed.rollout_workers": 1, "distributed.sync_timeout": 120,
        "distributed.collective_timeout": 120}))
    recs = _steps(run)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["moe/routing_mismatch"] == 0.0 for r in recs)  # recorded (else no metric) and replayed
    assert recs[1]["moe/router_drift"] > 0.0  # the weights had moved since the worker sampled


@pytest.mark.parametrize("arch", ARCHS)
def test_router_aux_is_the_load_balancing_loss(moe_model, arch):
    """The per-token terms of `router balance` average to transformers' load_balancing_loss_func
    over the same tokens (one row, no padding), and carry the routers' gradient."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    model = AutoModelForCausalLM.from_pretrained(moe_model(arch))
    ids = torch.randint(0, 200, (1, 12))
    attn = torch.ones_like(ids)
    with moe.routing(model, replay=False, stats=None, aux=True):
        out = token_logprobs(model, Forward(ids, attn, 11), LogprobOptions(router_aux=True))
        lp, aux = out.logprobs, out.router_aux
    out = model(ids, output_router_logits=True)
    E, K = model.config.num_local_experts, model.config.num_experts_per_tok
    # the padded forward feeds ids[:, :-1]: the reference sees those tokens
    ref = load_balancing_loss_func(tuple(g[:11] for g in out.router_logits), E, K)
    assert torch.allclose(aux.mean(), ref, atol=1e-6), (float(aux.mean()), float(ref))
    aux.mean().backward()
    assert all(g.weight.grad is not None and bool(g.weight.grad.abs().sum() > 0) for g in moe.routers(model))


class ToolReplies:
    """An environment that answers each of the model's first two turns with a tool result (the
    chat template's tool-response markup: prompt tokens of the next turn), and ends on the third."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message: dict):
        self.turns += 1
        if self.turns == 3:
            return [], 1.0, True
        return [{"role": "tool", "name": "get_weather", "content": f"sunny, {20 + self.turns} C"}], None, False


def _short_turns(folder, out):
    """The model folder with every other token id an end of turn (its generation_config's EOS
    ids): the random model's turns stop after a few tokens, so its episodes go on to the tools."""
    import shutil

    from transformers import GenerationConfig
    shutil.copytree(folder, out)
    cfg = json.loads((out / "config.json").read_text())
    GenerationConfig(eos_token_id=list(range(1, cfg["vocab_size"], 2)), pad_token_id=cfg["pad_token_id"],
                     bos_token_id=cfg["bos_token_id"]).save_pretrained(out)
    return out


def _episodes(folder) -> tuple[torch.nn.Module, RolloutBatch]:
    from rldsl.runtime.rollout.episodes.runner import run_episodes
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    engine = HFEngine(copy.deepcopy(model), load_tokenizer(folder))
    rows = [{"prompt": p, "answer": ""} for p in PROMPTS[:3]]
    params = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=0, top_p=1.0)
    batch = run_episodes(engine, engine.tokenizer, rows, [ToolReplies() for _ in range(6)], params, max_turns=3)
    return model, batch


@pytest.mark.parametrize("arch", ARCHS)
def test_tool_episode_routing_is_recorded_and_replayed(moe_model, arch, tmp_path):
    """A three-turn episode (tool results between the turns): every token fed is recorded -- the
    model's as sampled, the tool results' in the next turn's prefill -- laid out as the trainer's
    columns; at the engine's weights the trainer routes as recorded; after an Adam step the replayed
    logprobs equal the rows run alone under the recorded experts (1e-6), the mismatch 0."""
    model, batch = _episodes(_short_turns(moe_model(arch), tmp_path / "m"))
    check_episode_routing(model, batch)


@pytest.mark.slow  # an endpoint and its client: ~10-25 s on two shared cores
def test_agent_calls_routing_is_recorded_and_replayed(moe_model):
    """An agent's three chat calls with tools through the OpenAI-compatible endpoint (HF engine):
    each call's prefill and samples are recorded, stitched into the episode's row as the built-in
    episodes' are, and replayed."""
    pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from rldsl.runtime.rollout.agents.runner import AgentRunner, load_agent
    folder = moe_model("qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    engine = HFEngine(copy.deepcopy(model), load_tokenizer(folder))
    runner = AgentRunner(load_agent("agent_helpers:three_calls"), model_name="moe", context=512)
    try:
        batch = runner.run(engine, PROMPTS[:2], ["", ""], SamplingParams(n=2, max_new_tokens=8, seed=3))
    finally:
        runner.close()
    assert all(e.agent.rows == 1 and len(e.agent.calls) == 3 for e in batch.episodes)
    check_episode_routing(model, batch)


@pytest.mark.slow
def test_episode_run_with_replay(moe_model, tmp_path):
    """rollout.env episodes of a MoE policy train with replay: asynchronous (the routers moved since
    the sampling), the replayed forward's mismatch 0."""
    from rldsl.runtime.run import loop
    run = loop.train("grpo", _moe_config(_short_turns(moe_model("qwen3_moe"), tmp_path / "m"), tmp_path / "env", **{
        "train.steps": 2, "rollout.env": f"{__name__}:ToolReplies", "rollout.max_turns": 3}))
    recs = _steps(run)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["moe/routing_mismatch"] == 0.0 for r in recs)
    assert recs[1]["moe/router_drift"] > 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_on_fused_experts_merges_into_the_plain_model(moe_model, arch):
    """`gate_up_proj` / `down_proj` in model.lora.target_modules adapt the fused expert parameters
    (peft's target_parameters): the merged weights, loaded into the plain model, give the adapted
    model's logits; with the adapters off it is the base model."""
    pytest.importorskip("peft")
    from rldsl.runtime.models.lora import adapters_disabled, apply_lora, merged_weights
    base = AutoModelForCausalLM.from_pretrained(moe_model(arch)).eval()
    plain = copy.deepcopy(base)
    model, wrapped = apply_lora(copy.deepcopy(base), rank=4, alpha=8.0, dropout=0.0,
                                target_modules=["q_proj", "gate_up_proj", "down_proj"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("mlp.experts" in n for n in trainable) and any("q_proj" in n for n in trainable)
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n in trainable)  # base experts frozen
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    merged = merged_weights(model)
    assert merged.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged)
    ids = torch.randint(0, 200, (2, 12))
    with torch.no_grad():
        adapted, ref = model(ids).logits, plain(ids).logits
        with adapters_disabled(wrapped):
            off = model(ids).logits
    assert (adapted - ref).abs().max() < 1e-5
    assert (adapted - off).abs().max() > 1e-2 and (off - base(ids).logits).abs().max() < 1e-6


def test_expert_lora_with_fsdp_trainers_is_refused(moe_model, real_model):
    """The FSDP2 trainers' sync merges Linear adapters only: fused-expert targets with
    distributed.trainers > 1 are refused before a model loads (a dense model's down_proj is not)."""
    from rldsl.runtime.resolve import check_expert_lora
    over = {"model": {"lora": {"rank": 4, "target_modules": ["q_proj", "down_proj"]}}, "distributed": {"trainers": 2}}
    with pytest.raises(ConfigError, match="fused expert parameters"):
        check_expert_lora(RunConfig.model_validate(over), moe_model("qwen3_moe"))
    assert check_expert_lora(RunConfig.model_validate(over), real_model("qwen2.5")) is None
    over["distributed"]["trainers"] = 1
    assert check_expert_lora(RunConfig.model_validate(over), moe_model("qwen3_moe")) is None


@pytest.mark.slow
def test_lora_on_fused_experts_trains_with_replay(moe_model, tmp_path):
    """LoRA on a Qwen3-MoE's fused experts and attention: the expert adapters train, the base experts
    stay, the engine samples with the merged weights (the trainer's logprobs are the engine's at step
    1) and the replayed forwards route as the engine did."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from rldsl.runtime.run import loop
    folder = moe_model("qwen3_moe")
    run = loop.train("grpo", _moe_config(folder, tmp_path / "run", **{
        "model.lora.rank": 4, "model.lora.target_modules": '["q_proj","gate_up_proj","down_proj"]',
        "checkpoint.every": 3}))
    recs = _steps(run)
    assert [r["step"] for r in recs] == [1, 2, 3] and any(r["optimizer_steps"] > 0 for r in recs)
    assert all(r["moe/routing_mismatch"] == 0.0 for r in recs)
    assert recs[0]["rollout_logprob_diff"] < 1e-4
    state = load_file(str(run / "checkpoints" / "step-3" / "policy" / "model.safetensors"))
    moved = [k for k in state if ".lora_B." in k and bool(state[k].abs().sum() > 0)]
    assert any("mlp.experts" in k for k in moved)
    fresh = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    experts = [k for k in state if k.endswith(("gate_up_proj", "down_proj"))]
    assert len(experts) == 4
    for k in experts:
        plain = k.replace("base_model.model.", "").replace(".base_layer", "")
        assert torch.equal(state[k], fresh[plain]), k


@pytest.mark.slow
def test_a_full_weight_moe_run_is_exported_and_evaluated(moe_model, tmp_path):
    """A full-weight MoE run's checkpoint holds its experts one tensor per expert (the released
    layout): `rldsl export` writes it as a plain folder whose weights are the checkpoint's, and
    `rldsl eval` reads it, both through the loader the resume path uses."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from rldsl.cli import app
    from rldsl.runtime.records.checkpoint import load_weights
    from rldsl.runtime.run import loop

    run = loop.train("grpo", _moe_config(moe_model("qwen3_moe"), tmp_path / "run", **{
        "train.steps": 1, "checkpoint.every": 1, "rollout.max_staleness": 0, "rollout.routing_replay": "false"}))
    saved = load_file(str(run / "checkpoints" / "step-1" / "policy" / "model.safetensors"))
    assert any(".experts.0." in k for k in saved)  # the released layout, one tensor per expert
    res = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "plain")])
    assert res.exit_code == 0, res.output
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    trained = AutoModelForCausalLM.from_pretrained(moe_model("qwen3_moe"))
    load_weights(trained, run / "checkpoints" / "step-1" / "policy")
    a, b = exported.state_dict(), trained.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+3=", "answer": str(i + 3)}) + "\n" for i in range(2)))
    res = CliRunner().invoke(app, ["eval", str(run), "--data", str(data), "--n", "1", "--out", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    assert 0.0 <= json.loads((tmp_path / "m.json").read_text())["eval/t/greedy_acc"] <= 1.0
