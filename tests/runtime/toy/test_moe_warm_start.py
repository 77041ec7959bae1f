"""The toy's warm start of another causal LM on its vocabulary: the MoE demo's (demos/moe.py)."""
from __future__ import annotations

import json

from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from rldsl.runtime import toy
from rldsl.runtime.models import moe


def _config() -> Qwen3MoeConfig:
    tok = toy.build_tokenizer()
    return Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def test_warm_start_of_a_moe_config_is_that_model_cached_apart(tmp_path) -> None:
    tok, cfg = toy.build_tokenizer(), _config()
    settings = toy.WarmStartConfig(max_steps=2, eval_every=1, batch_size=8)
    path = toy.warm_start(settings, model_config=cfg, cache=tmp_path)
    assert path.name == toy.warm_start_key(settings, _config()) != toy.warm_start_key(settings, toy.tiny_config(tok))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen3_moe" and moe.is_moe(model)
    assert json.loads((path / "warm_start.json").read_text())["steps"] == 2
    assert toy.warm_start(settings, model_config=_config(), cache=tmp_path) == path  # cached
