"""The policy's structure: backbone, tied parameters, the KV-cache kind, a model on meta."""
from __future__ import annotations

import torch

from rldsl.runtime.models.loading import backbone, plain_kv_cache, policy_on_meta, tensors_by_name, tied_names, with_tied


def test_tied_embedding_is_one_parameter_under_two_names(tiny_model) -> None:
    assert tied_names(tiny_model) == [["model.embed_tokens.weight", "lm_head.weight"]]
    state = {"model.embed_tokens.weight": torch.zeros(3)}
    full = with_tied(state, tiny_model)
    assert full["lm_head.weight"] is state["model.embed_tokens.weight"] and "lm_head.weight" not in state
    names = tensors_by_name(tiny_model)
    assert names["lm_head.weight"] is names["model.embed_tokens.weight"]


def test_backbone_and_cache_kind(tiny_model) -> None:
    assert backbone(tiny_model) is tiny_model.model
    assert plain_kv_cache(tiny_model)  # Llama: full attention in every layer


def test_policy_on_meta_holds_the_given_state(model_dir, tiny_model_factory, tokenizer) -> None:
    real = tiny_model_factory(tokenizer, seed=0)
    state = {k: v for k, v in real.state_dict().items() if k != "lm_head.weight"}  # as saved
    model = policy_on_meta(model_dir, state)
    assert torch.equal(model.lm_head.weight, real.model.embed_tokens.weight)
    assert torch.equal(model.model.norm.weight, real.model.norm.weight)
    assert policy_on_meta(model_dir).model.norm.weight.is_meta
