"""The tool-use demo's model: a character tokenizer whose Hermes boilerplate pieces are whole
tokens, a Qwen/Hermes-style chat template that renders tools, and a tiny Llama config
(docs/tool_use.md).

Decoding gives exactly the Hermes text the ``hermes`` tool-call parser reads:
``<tool_call>\\n{"name": "calculator", "arguments": {"expression": "12+34+56"}}\\n</tool_call>``
is 6 whole tokens plus one per character of the expression. ``<|im_end|>`` is the EOS (a
special token, dropped from decoded completions); the other added tokens are not special and
stay in the decoded text.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from .calculator import TOOL_NAME
from .model import tiny_config

TOOL_SPECIAL_TOKENS = ("<pad>", "<|im_end|>", "<unk>")
#: Hermes/Qwen pieces as whole tokens (not special: they stay in decoded text).
HERMES_TOKENS = (
    "<|im_start|>", "system\n", "user\n", "assistant\n",
    "<tools>", "</tools>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    f'{{"name": "{TOOL_NAME}", "arguments": {{"expression": "', '"}}',
)
TOOL_CHARACTERS = "0123456789+-*/=,.:;()[]{}<>\"'_ \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

#: Qwen2.5/Hermes layout, made compact for a character model: the system turn lists the tools'
#: names in ``<tools>...</tools>`` (not their JSON schemas, ~250 characters each); tool results
#: come back in a user turn as ``<tool_response>\n...\n</tool_response>``. An assistant message's
#: ``tool_calls`` (if any) are rendered as Hermes calls after its content.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n<tools>"
    "{% for t in tools %}{{ t.function.name if t.function is defined else t.name }}"
    "{% if not loop.last %},{% endif %}{% endfor %}</tools>"
    "{% if messages and messages[0].role == 'system' %}\n{{ messages[0].content }}{% endif %}"
    "<|im_end|>\n"
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}"
    "<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ m.content if m.content else '' }}"
    "{% for tc in (m.tool_calls or []) %}"
    "{% set f = tc.function if tc.function is defined else tc %}"
    "<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """Characters (``TOOL_CHARACTERS``) plus the ``HERMES_TOKENS`` as whole tokens, the chat
    template ``CHAT_TEMPLATE``, EOS ``<|im_end|>``, pad ``<pad>`` (0), left padding, no BOS.
    Any other character becomes ``<unk>``."""
    vocab = {tok: i for i, tok in enumerate((*TOOL_SPECIAL_TOKENS, *TOOL_CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TOOL_SPECIAL_TOKENS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in HERMES_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tool_model_config(tokenizer: PreTrainedTokenizerFast | None = None, *, hidden_size: int = 96,
                      num_hidden_layers: int = 4, num_attention_heads: int = 4,
                      intermediate_size: int = 384, max_position_embeddings: int = 128) -> LlamaConfig:
    """The toy's Llama (toy/model.py) with the tool tokenizer's vocabulary and 128 positions
    (a whole episode: prompt, call, result, answer, ~60 tokens)."""
    tok = tokenizer if tokenizer is not None else build_tool_tokenizer()
    return tiny_config(tok, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                       num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                       max_position_embeddings=max_position_embeddings)
