"""A model's context bounds prompt + completion: clip ``max_new_tokens`` once, or refuse up front."""
from __future__ import annotations

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from rldsl.runtime.resolve import fit_context, resolve
from rldsl.runtime.config import load_config
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.models.loading import model_context
from rldsl.runtime.data.sources import max_new_tokens, settle, source_of


@pytest.fixture
def gpt2_64(tmp_path, tokenizer):
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2,
                                       n_positions=64, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def settled(cfg):
    """A config as the plan hands it to resolve: the source's defaults filled in."""
    return settle(cfg, source_of(cfg))[0]


def test_default_max_new_tokens_is_clipped_to_the_context_with_one_note(gpt2_64, tokenizer, tmp_path):
    assert model_context(gpt2_64) == 64
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    cfg = load_config(None, [f"model.path={gpt2_64}", f"data.path={data}"])
    assert max_new_tokens(cfg) == 1024  # the default for a user's model and data
    prompts = ["1+2=", "12+34=", "99+99="]  # longest: <bos> + 6 characters = 7 tokens
    resolved, notes = resolve(settled(cfg), gpt2_64, tokenizer, prompts)
    assert resolved.rollout.max_new_tokens == 64 - 7 and cfg.rollout.max_new_tokens is None  # a copy
    clipped = [n for n in notes if "max_new_tokens" in n]
    assert clipped == ["max_new_tokens 1024 + the longest prompt (7 tokens) exceeds the model's context "
                       "of 64 positions: generating at most 57 new tokens (set rollout.max_new_tokens "
                       "to silence this)"]
    again, notes = resolve(resolved, gpt2_64, tokenizer, prompts)  # already clipped: no second note
    assert again == resolved and not [n for n in notes if "max_new_tokens" in n]


def test_a_fitting_request_is_left_alone(gpt2_64, tokenizer):
    cfg = load_config(None, [f"model.path={gpt2_64}", "rollout.max_new_tokens=8"])
    resolved, notes = resolve(settled(cfg), gpt2_64, tokenizer, ["1+2="])
    assert resolved.max_new_tokens == 8 and notes == []
    with pytest.raises(ValueError, match="not settled"):  # the plan settles first: resolve never asks the table
        resolve(cfg, gpt2_64, tokenizer, ["1+2="])


def test_a_prompt_longer_than_the_context_is_refused_before_the_first_step(gpt2_64, tokenizer):
    cfg = load_config(None, [f"model.path={gpt2_64}"])
    with pytest.raises(ConfigError, match=r"a prompt.* has 71 tokens .* context of 64 positions"):
        resolve(settled(cfg), gpt2_64, tokenizer, ["1+2=", "1" * 70])
    assert fit_context(100, None, 5000, "m") == (100, None)  # a model that names no context: unclipped


def test_a_vllm_cpu_prefill_budget_below_a_prompt_is_refused_and_below_the_context_noted():
    """vLLM 0.32's CPU build fails on seeded requests prefilled in chunks, and a run seeds every
    request: a max_num_batched_tokens below the longest prompt is refused (exit 2), below the
    context of an episode run noted; vLLM's default budget, the HF engine and a GPU pass."""
    from rldsl.runtime.resolve import vllm_prefill_budget_note
    cfg = lambda *sets: load_config(None, ["rollout.engine=vllm", *sets])  # noqa: E731
    budget = 'rollout.vllm.engine_kwargs={"max_num_batched_tokens": 32}'
    with pytest.raises(ConfigError, match="max_num_batched_tokens=32 is below the longest prompt") as e:
        vllm_prefill_budget_note(cfg(budget), 40, 128)
    assert e.value.exit_code == 2
    assert vllm_prefill_budget_note(cfg(budget), 30, 128) is None  # single-turn prompts fit
    note = vllm_prefill_budget_note(cfg(budget, "rollout.env=episode_helpers:Nudge"), 30, 128)
    assert note is not None and "below the context (128)" in note
    assert vllm_prefill_budget_note(cfg(budget, "rollout.env=episode_helpers:Nudge", "rollout.vllm.max_model_len=32"),
                                    30, 128) is None
    assert vllm_prefill_budget_note(cfg(), 4000, 128) is None
    assert vllm_prefill_budget_note(cfg(budget, "device=cuda"), 40, 128) is None
    assert vllm_prefill_budget_note(load_config(None, [budget]), 40, 128) is None  # the HF engine
