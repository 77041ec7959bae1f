"""Tool-call parsers by name: the model's text -> its calls (or what is wrong with them)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's name and its arguments."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolCallError:
    """A call the model tried to make that cannot run; ``message`` is what the model sees."""

    message: str


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_hermes(text: str) -> list[ToolCall | ToolCallError]:
    """Hermes / Qwen calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
    whitespace tolerant, several per message; an unclosed ``<tool_call>`` is an error."""
    out: list[ToolCall | ToolCallError] = []
    out = [_json_call(body, "arguments") for body in _HERMES.findall(text)]
    if text.count("<tool_call>") > len(_HERMES.findall(text)):
        out.append(ToolCallError("error: <tool_call> without </tool_call>"))
    return out


def _json_call(body: str, key: str) -> ToolCall | ToolCallError:
    """``{"name": ..., key: {...}}`` (the arguments may also be a JSON string of an object)."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(f"error: the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCallError(f'error: a tool call needs {{"name": "...", "{key}": {{...}}}}')
    args = call.get(key, call.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCallError(f"error: the {key} of {call['name']} must be a JSON object")
    return ToolCall(call["name"], args)


def parse_llama3_json(text: str) -> list[ToolCall | ToolCallError]:
    """Llama 3.1 / 3.2 calls (their released templates' format): the whole message is one JSON
    object ``{"name": ..., "parameters": {...}}`` (``arguments`` also read), optionally after
    ``<|python_tag|>``; a message that does not start with ``{`` is an answer, not a call."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    return [_json_call(body, "parameters")] if body.startswith("{") else []


TOOL_CALL_PARSERS: dict[str, Callable[[str], list[ToolCall | ToolCallError]]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parse_tool_calls(name: str, text: str) -> list[ToolCall | ToolCallError]:
    """The calls in ``text`` read by the parser ``name`` (a key of ``TOOL_CALL_PARSERS``)."""
    return TOOL_CALL_PARSERS[name](text)


def text_for_tools(tokenizer: Any, ids: list[int], stopped: bool) -> str:
    """A model turn's text as the tool parser reads it: ``ids`` decoded with the special tokens
    kept -- a tokenizer may declare the parser's markers special (Hermes-style ``<tool_call>``;
    Mistral's ``[TOOL_CALLS]`` and Llama 3.1's ``<|python_tag|>`` are, by design), and decoding
    with ``skip_special_tokens=True`` would drop them and with them the call -- but without the
    stop token that ended the turn (``stopped``: the last id is one). vLLM's server decodes a
    request with tools the same way (its ``hermes`` parser turns ``skip_special_tokens`` off;
    its detokenizer leaves the stop token out)."""
    return tokenizer.decode(ids[:-1] if stopped and ids else ids, skip_special_tokens=False)
