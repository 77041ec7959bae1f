"""Shared fixtures: the toy tokenizer and a tiny random-init Llama (fast, not the warm start)."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rldsl.runtime import toy

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


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama with the toy tokenizer, saved as a user model folder."""
    path = tmp_path_factory.mktemp("tiny-model")
    make_tiny_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """A small tool model that has learned the call format (always calls: TeacherMix.call=1), as
    an HF folder; shared by the agent and environment tests."""
    from rldsl.runtime.toy.calculator import SumTask, TeacherMix
    from rldsl.runtime.toy.tool_model import tool_model_config
    from rldsl.runtime.toy.tool_warmup import ToolWarmStartConfig, tool_warm_start

    config = ToolWarmStartConfig(steps=300, batch_size=16, lr=3e-3, mix=TeacherMix(call=1.0),
                                 task=SumTask(num_train=2000, num_validation=10))
    small = tool_model_config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    torch.set_num_threads(1)
    return tool_warm_start(config, model_config=small, cache=tmp_path_factory.mktemp("cache"))
