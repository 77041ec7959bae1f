"""A model's context bounds prompt + completion: clip ``max_new_tokens`` once, or refuse up front."""
from __future__ import annotations

import warnings

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from rldsl.runtime.build import fit_context, model_context
from rldsl.runtime.config import ConfigError, load_config


@pytest.fixture
def gpt2_64(tmp_path, tokenizer):
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2,
                                       n_positions=64, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_default_max_new_tokens_is_clipped_to_the_context_with_one_warning(gpt2_64, tokenizer, tmp_path):
    assert model_context(gpt2_64) == 64
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    cfg = load_config(None, [f"model.path={gpt2_64}", f"data.path={data}"])
    assert cfg.max_new_tokens == 1024  # the default for a user's model and data
    prompts = ["1+2=", "12+34=", "99+99="]  # longest: <bos> + 6 characters = 7 tokens
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_context(cfg, gpt2_64, tokenizer, prompts)
        fit_context(cfg, gpt2_64, tokenizer, prompts)  # already clipped: no second warning
    assert cfg.max_new_tokens == 64 - 7
    assert [str(w.message) for w in caught if "max_new_tokens" in str(w.message)] and len(caught) == 1


def test_a_fitting_request_is_left_alone(gpt2_64, tokenizer):
    cfg = load_config(None, [f"model.path={gpt2_64}", "rollout.max_new_tokens=8"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_context(cfg, gpt2_64, tokenizer, ["1+2="])
    assert cfg.max_new_tokens == 8


def test_a_prompt_longer_than_the_context_is_refused_before_the_first_step(gpt2_64, tokenizer):
    cfg = load_config(None, [f"model.path={gpt2_64}"])
    with pytest.raises(ConfigError, match=r"longest prompt has 71 tokens .* context of 64 positions"):
        fit_context(cfg, gpt2_64, tokenizer, ["1+2=", "1" * 70])
