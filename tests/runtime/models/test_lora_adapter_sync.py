"""``model.lora.sync = "adapter"``: the adapters alone go to the rollout engines.

Checked here (no vLLM): what the config refuses before any model loads (exit code 2); the
adapter folder written for vLLM is one peft itself loads to the trainer's outputs; the hf
engine's own LoRA layers sample what the merged weights sample (a one-process run equals the
merged run), and ``sync/bytes`` is the adapters'. vLLM's side: tests/runtime/rollout/engines/
test_vllm_lora.py (the vLLM venv).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("peft")

import rldsl  # noqa: E402
from rldsl.runtime.config import load_config  # noqa: E402
from rldsl.runtime.errors import ConfigError, RunError  # noqa: E402
from rldsl.runtime.models.lora import adapter_of, apply_lora, load_adapter  # noqa: E402
from rldsl.runtime.resolve import check_lora_sync, check_model_kind, check_settings, folder_moe  # noqa: E402
from rldsl.runtime.run import loop  # noqa: E402
from small_run import small_run, steps_of, without_timing  # noqa: E402

ADAPTER = ["model.lora.rank=4", "model.lora.sync=adapter"]


def test_the_default_is_merged_and_adapter_sync_is_checked_before_loading(vlm_model, moe_model):
    assert load_config(None, []).model.lora.sync == "merged"
    grpo = rldsl.load("grpo")
    check_settings(grpo, load_config(None, ADAPTER))  # hf engine, one process
    check_settings(grpo, load_config(None, [*ADAPTER, "distributed.rollout_workers=1"]))  # auto: object store
    check_settings(grpo, load_config(None, [*ADAPTER, "distributed.rollout_workers=1",
                                            "distributed.weight_sync=collective"]))
    vllm = load_config(None, [*ADAPTER, "rollout.engine=vllm", "model.lora.rank=64"])
    check_lora_sync(vllm, folder_moe(vllm))
    refused = {
        "model.lora.rank=0": ["model.lora.sync=adapter"],
        "vLLM serves LoRA ranks up to 512": [*ADAPTER, "rollout.engine=vllm", "model.lora.rank=600"],
        "not an embedding's or the output head's": [*ADAPTER, "rollout.engine=vllm",
                                                 "model.lora.target_modules=[q_proj, lm_head]"],
        "fused expert parameters": [*ADAPTER, f"model.path={moe_model('qwen3_moe')}",
                                    "model.lora.target_modules=[q_proj, gate_up_proj]"],
        "mixture-of-experts model": [*ADAPTER, "rollout.engine=vllm", f"model.path={moe_model('mixtral')}",
                                     "model.lora.target_modules=[q_proj, v_proj]"],
    }
    for message, sets in refused.items():
        with pytest.raises(ConfigError, match=message) as e:
            cfg = load_config(None, sets)
            check_lora_sync(cfg, folder_moe(cfg))
        assert e.value.exit_code == 2
    # a vision-language policy's refusal is its model kind's (models/kinds/qwen2_vl.py), which check_settings asks
    with pytest.raises(ConfigError, match="vision-language model: model.lora.sync='adapter' on the vLLM") as e:
        check_model_kind(grpo, load_config(None, [*ADAPTER, "rollout.engine=vllm", f"model.path={vlm_model}"]))
    assert e.value.exit_code == 2


def test_the_adapter_folder_is_a_peft_adapter_of_the_trained_policy(tiny_model, tmp_path):
    """What vLLM's LoRARequest loads: peft's own loader reads it back to the trainer's logits."""
    from peft import PeftModel
    policy, _ = apply_lora(copy.deepcopy(tiny_model), rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    for name, p in policy.named_parameters():
        if ".lora_B." in name:  # B starts at 0: adapters that change the outputs
            torch.nn.init.normal_(p, std=0.1)
    adapter = adapter_of(policy)
    assert adapter.rank == 4 and adapter.alpha == 8
    assert adapter.target_modules() == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    folder = adapter.save(tmp_path / "v1")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    loaded = PeftModel.from_pretrained(copy.deepcopy(tiny_model), str(folder)).eval()
    ids = torch.tensor([[1, 5, 6, 14, 7, 8, 17]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, policy(ids).logits, atol=1e-6, rtol=0)
        assert not torch.allclose(tiny_model(ids).logits, policy(ids).logits, atol=1e-3)
    engine_model = copy.deepcopy(tiny_model)  # the hf engine's copy: LoRA layers injected, then copied
    load_adapter(engine_model, adapter)
    with torch.no_grad():
        torch.testing.assert_close(engine_model(ids).logits, policy(ids).logits, atol=0, rtol=0)
    with pytest.raises(RunError, match="rank changed"):
        load_adapter(engine_model, adapter_of(apply_lora(copy.deepcopy(tiny_model), rank=2, alpha=8, dropout=0.0,
                                                         target_modules=["all-linear"])[0]))


@pytest.mark.slow
def test_hf_engine_run_with_adapters_equals_the_merged_run(model_dir, tmp_path):
    """3 steps in one process: the same samples, rewards and losses whether the engine gets the
    merged weights or the adapters alone (its own LoRA layers); sync/bytes is the adapters'."""
    runs = {mode: steps_of(loop.train("grpo", small_run(model_dir, tmp_path / mode, "eval.samples=0",
                                                          "data.eval_size=4", "model.lora.rank=4", "train.lr=1e-2",
                                                          f"model.lora.sync={mode}")))
            for mode in ("merged", "adapter")}
    merged, adapter = runs["merged"], runs["adapter"]
    assert any(r["optimizer_steps"] > 0 for r in merged)
    for a, b in zip(without_timing(merged), without_timing(adapter)):
        assert a["reward_mean"] == b["reward_mean"] and a["response_length"] == b["response_length"]
        for k in ("loss", "pg_loss", "grad_norm", "kl", "rollout_logprob_diff"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    assert all(b["sync/bytes"] * 5 < a["sync/bytes"] for a, b in zip(merged, adapter))
