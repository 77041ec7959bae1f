"""LoRA (peft): only adapters train, the reference is the policy with adapters off, the
engine gets merged weights, checkpoints resume exactly, export gives a plain HF folder."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("peft")

from rldsl.runtime.records import checkpoint as ckpt  # noqa: E402
from rldsl.runtime.run import loop  # noqa: E402
from rldsl.runtime.run import step as run_step  # noqa: E402
from rldsl.runtime.run.build import build_run  # noqa: E402
from rldsl.runtime.records.export import export_run  # noqa: E402
from rldsl.runtime.models.lora import (adapters_disabled, apply_lora, lora_layers, lora_scalings,  # noqa: E402
                                merge_state, merged_weights)
from rldsl.runtime.errors import RunError  # noqa: E402
from rldsl.runtime.records.metrics import read_metrics  # noqa: E402
from rldsl.runtime.records.metrics import TIMED  # noqa: E402
from small_run import small_run  # noqa: E402


def lora_config(model_dir, out, **over):
    """Rank-4 adapters at lr 1e-2: adapters that move in 3 steps."""
    return small_run(model_dir, out, "eval.samples=0", "data.eval_size=4", "model.lora.rank=4", "train.lr=1e-2",
                     **over)


def test_merged_weights_and_adapters_off(tiny_model) -> None:
    base = copy.deepcopy(tiny_model)
    model, wrapped = apply_lora(copy.deepcopy(tiny_model), rank=4, alpha=8, dropout=0.0,
                                target_modules=["all-linear"])
    layers = lora_layers(model)
    assert len(layers) == 14  # 7 linear layers x 2 blocks; the output head has none
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n, _ in model.named_parameters() if ".lora_" in n}
    for layer in layers.values():  # B starts at 0: make the adapters do something
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    merged = merged_weights(model)
    assert set(merged) == set(base.state_dict()) and not any("lora" in k for k in merged)
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged)
    ids = torch.tensor([[1, 5, 6, 14, 7, 8, 17]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
        assert not torch.allclose(base(ids).logits, model(ids).logits, atol=1e-3)
        with adapters_disabled(wrapped):  # the reference policy: the base model
            torch.testing.assert_close(model(ids).logits, base(ids).logits, atol=1e-6, rtol=0)


def test_adapters_are_added_without_a_deprecation_warning(tiny_model) -> None:
    """peft reads model.is_gradient_checkpointing, deprecated in transformers 5: a FutureWarning on
    every LoRA run's console."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        apply_lora(copy.deepcopy(tiny_model), rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    assert [str(w.message) for w in seen] == []


def test_a_moe_models_fused_expert_adapters_get_peft_rank_pattern_without_its_false_warning(moe_model) -> None:
    """peft gives the fused gate_up_proj twice the rank (gate and up in one), then warns that this pattern
    "did not match any targeted module and was ignored": a false alarm on every MoE LoRA run's console."""
    model = AutoModelForCausalLM.from_pretrained(moe_model("qwen3_moe"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, wrapped = apply_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    assert [str(w.message) for w in seen] == []
    experts = model.model.layers[0].mlp.experts
    assert wrapped.peft_config["default"].rank_pattern == {r".*\.gate_up_proj": 8}
    assert experts.base_layer.lora_A["default"].weight.shape[0] == experts.base_layer.num_experts * 8  # applied


def test_merge_state_equals_peft_merge(tiny_model) -> None:
    """The distributed trainer merges a gathered state dict (no LoRA modules behind it): the
    same tensors as peft's ``get_delta_weight`` merge; an unknown LoRA tensor is refused."""
    model, _ = apply_lora(tiny_model, rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    for layer in lora_layers(model).values():
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    scalings = lora_scalings(model)
    assert len(scalings) == 14 and {s for s, _ in scalings.values()} == {2.0}  # alpha / r
    merged, expected = merge_state(model.state_dict(), scalings), merged_weights(model)
    assert merged.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(merged[k], v, atol=1e-7, rtol=0)
    state = dict(model.state_dict())
    state["model.layers.0.mlp.up_proj.lora_magnitude_vector.default.weight"] = torch.ones(64)
    with pytest.raises(RunError, match="LoRA tensors with no merge rule"):
        merge_state(state, scalings)


@pytest.mark.slow
def test_lora_run_trains_adapters_syncs_merged_weights_and_exports(model_dir, tmp_path) -> None:
    (tmp_path / "run").mkdir()
    s = build_run("grpo", lora_config(model_dir, tmp_path / "run"), tmp_path / "run")
    trainer = s.trainers.trainer
    assert trainer.reference is None and trainer.reference_off is not None  # no second copy
    frozen = {k: v.clone() for k, v in trainer.policy.state_dict().items() if ".lora_" not in k}
    for step in range(2):
        m = run_step.train_step(s, step)
    assert m["optimizer_steps"] >= 1 and "kl" in m
    after = trainer.policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())  # only adapters moved
    assert any(float(v.abs().max()) > 0 for k, v in after.items() if ".lora_B" in k)
    engine = s.rollouts.engine.model.state_dict()
    merged = merged_weights(trainer.policy)
    assert set(engine) == set(merged)
    for k, v in merged.items():
        torch.testing.assert_close(engine[k], v, atol=0, rtol=0)
    moved = [k for k in merged if k.replace(".weight", ".base_layer.weight") in frozen
             and not torch.equal(merged[k], frozen[k.replace(".weight", ".base_layer.weight")])]
    assert moved  # the engine samples from base + adapters


@pytest.mark.slow
def test_lora_checkpoint_resumes_exactly_and_exports(model_dir, tmp_path) -> None:
    full = loop.train("grpo", lora_config(model_dir, tmp_path / "full", **{"checkpoint.every": 2, "train.steps": 4}))
    cut = loop.train("grpo", lora_config(model_dir, tmp_path / "cut", **{"checkpoint.every": 2, "train.steps": 4}),
                     stop_after=2)
    loop.train("grpo", resume=cut)
    a = load_file(str(ckpt.latest_checkpoint(full) / "policy" / "model.safetensors"))
    b = load_file(str(ckpt.latest_checkpoint(cut) / "policy" / "model.safetensors"))
    assert any(".lora_A" in k for k in a)  # the checkpoint holds the adapter
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(TIMED)}
                        for r in rs if "reward_mean" in r]
    assert strip(read_metrics(full / "metrics.jsonl")) == strip(read_metrics(cut / "metrics.jsonl"))

    out = export_run(full, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    assert not any("lora" in k for k in load_file(str(out / "model.safetensors")))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    model, _ = apply_lora(model, rank=4, alpha=16.0, dropout=0.0, target_modules=["all-linear"])
    ckpt.load_weights(model, ckpt.latest_checkpoint(full) / "policy")
    ids = torch.tensor([[1, 5, 6, 14, 7, 8, 17]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("12+3=")["input_ids"] == AutoTokenizer.from_pretrained(str(model_dir))("12+3=")["input_ids"]
    with pytest.raises(RunError, match="no checkpoint of step 3 \\(checkpoints: step-2, step-4\\)"):
        export_run(full, tmp_path / "other", step=3)
    with pytest.raises(RunError, match="not empty"):
        export_run(full, out)


def test_distributed_checkpoint_gather_rebuilds_lora_policy_and_critic(model_dir, tmp_path) -> None:
    """The Ray driver saves the ranks' gathered full states through modules rebuilt on the meta
    device: under LoRA they carry the adapter layers (policy and a ppo critic), so the saved
    tensors are exactly the gathered ones, under the one-process names."""
    from rldsl.runtime.workers.ray_trainers import RayTrainers
    (tmp_path / "run").mkdir()
    cfg = lora_config(model_dir, tmp_path / "run")
    s = build_run("ppo", cfg, tmp_path / "run")
    t = s.trainers.trainer
    for name, p in t.critic.named_parameters():  # make the critic's adapters non-trivial
        if ".lora_B." in name:
            torch.nn.init.normal_(p, std=0.1)
    gathered = {"policy": t.policy.state_dict(), "critic": t.critic.state_dict(),
                "optimizer": t.optimizer.state_dict(), "critic_optimizer": t.critic_optimizer.state_dict(),
                "scheduler": None, "algorithm": {}}
    driver = object.__new__(RayTrainers)
    driver.cfg, driver.model_path = cfg, str(model_dir)
    driver._all = lambda method, what: [gathered]
    state = driver.checkpoint_state()
    for module, want in ((state.policy, gathered["policy"]), (state.critic, gathered["critic"])):
        got = module.state_dict()
        assert got.keys() == want.keys() and any(".lora_A." in k for k in got)
        assert all(torch.equal(got[k], want[k]) for k in want)
    path = ckpt.save_checkpoint(tmp_path / "run", 1, policy=state.policy, tokenizer=s.tokenizer,
                                optimizer=state.optimizer,
                                critic=state.critic, critic_optimizer=state.critic_optimizer,
                                scheduler=state.scheduler)
    saved = load_file(str(path / "policy" / "model.safetensors"))
    assert any(".lora_B." in k for k in saved)
