"""Shared fixtures: the toy tokenizer and a tiny random-init Llama (fast, not the warm start)."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rldsl.runtime import recipe, toy

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return toy.build_tokenizer()


def make_tiny_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> LlamaForCausalLM:
    """hidden 32, 2 layers, 2 heads: random init, eval mode, fp32."""
    config = toy.tiny_config(
        tokenizer, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture()
def tiny_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    return make_tiny_model(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_factory() -> Callable[..., LlamaForCausalLM]:
    """``tiny_model_factory(tokenizer, seed=1)`` -> another tiny model."""
    return make_tiny_model


@pytest.fixture(scope="session")
def unpadded_logits() -> Callable[..., list[torch.Tensor]]:
    """The reference below, as a fixture (test modules do not import each other)."""
    return _unpadded_logits


def _unpadded_logits(model: LlamaForCausalLM, prompt_ids, prompt_mask, response_ids, response_mask) -> list[torch.Tensor]:
    """Reference: each row run alone without padding (default positions, no mask).

    Returns, per row b, the fp32 logits [L_b, V] predicting its L_b real response tokens.
    """
    out = []
    for b in range(prompt_ids.shape[0]):
        prompt = prompt_ids[b][prompt_mask[b].bool()]  # [Lp]
        response = response_ids[b][response_mask[b].bool()]  # [L]
        ids = torch.cat([prompt, response]).unsqueeze(0)  # [1, Lp + L]
        logits = model(input_ids=ids).logits[0].float()  # [Lp + L, V]
        out.append(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)])  # [L, V]
    return out


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading weights fails the test: a check that needs no model must come first."""
    calls: list[str] = []

    def refuse(path, dtype):
        calls.append(str(path))
        raise AssertionError(f"the model at {path} was loaded before the check")

    monkeypatch.setattr(recipe, "load_policy", refuse)
    return calls
