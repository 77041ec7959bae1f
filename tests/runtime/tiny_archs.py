"""Tiny random-init causal LMs of several architectures, built locally with the toy tokenizer.

``build(name, tokenizer)`` returns an eval-mode fp32 model (hidden 32, 2 layers) of the
architecture; ``save(name, tokenizer, path)`` writes it as a user model folder. The LM head
is scaled up (logits of std ~2 instead of ~0.1) so that a soft cap, a logit scale or a
temperature visibly change the distribution: a test that forgot one of them would fail.
Gemma 2/3 get a soft cap of 2 (their checkpoints use 30 on much larger logits) and a sliding
window of 4 tokens, so their sliding-window layers really slide over the test sequences.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import transformers as tf

ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gpt2", "opt", "gemma2", "gemma3")
# models whose forward transforms the LM head's output (besides Gemma's soft cap)
SCALED = ("cohere", "granite")


def _configs(tokenizer) -> dict[str, tuple[Callable, object]]:
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    llm = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               intermediate_size=64, max_position_embeddings=64, **ids)
    return {
        "llama": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**llm)),
        "qwen2": (tf.Qwen2ForCausalLM, lambda: tf.Qwen2Config(**llm)),
        "qwen3": (tf.Qwen3ForCausalLM, lambda: tf.Qwen3Config(head_dim=16, **llm)),
        "phi3": (tf.Phi3ForCausalLM, lambda: tf.Phi3Config(**llm)),
        "gpt2": (tf.GPT2LMHeadModel, lambda: tf.GPT2Config(
            n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, **ids)),
        "opt": (tf.OPTForCausalLM, lambda: tf.OPTConfig(
            hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
            max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, **ids)),
        "gemma2": (tf.Gemma2ForCausalLM, lambda: tf.Gemma2Config(
            head_dim=16, final_logit_softcapping=2.0, sliding_window=4, **llm)),
        "gemma3": (tf.Gemma3ForCausalLM, lambda: tf.Gemma3TextConfig(
            head_dim=16, final_logit_softcapping=2.0, sliding_window=4, **llm)),
        "cohere": (tf.CohereForCausalLM, lambda: tf.CohereConfig(logit_scale=3.0, **llm)),
        "granite": (tf.GraniteForCausalLM, lambda: tf.GraniteConfig(logits_scaling=4.0, **llm)),
    }


def build(name: str, tokenizer, seed: int = 0) -> torch.nn.Module:
    """A tiny random-init ``name`` model (one of ARCHS or SCALED), eval mode, fp32."""
    cls, config = _configs(tokenizer)[name]
    torch.manual_seed(seed)
    model = cls(config()).eval()
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.mul_(2.0 / (model(input_ids=torch.tensor([[1, 4, 5, 6]])).logits.std() + 1e-6))
    return model


def save(name: str, tokenizer, path: Path, seed: int = 0) -> Path:
    """``build(name)`` saved with the tokenizer as a model folder (``--model path``)."""
    build(name, tokenizer, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
