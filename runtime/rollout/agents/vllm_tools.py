"""Tool calls read by vLLM's own parsers, for an agent endpoint whose engine is vLLM.

vLLM's OpenAI server reads a completion's tool calls with a registered parser
(``vllm.tool_parsers.ToolParserManager``: ``hermes``, ``llama3_json`` and some thirty more);
with ``rollout.engine = "vllm"`` the endpoint uses the same parser of the name
``rollout.tool_parser`` names, so an agent sees exactly the ``tool_calls`` vLLM's own server
would return for the same text. The chat *rendering* stays the endpoint's (server.py): vLLM's
server renders the whole history at every call, while the endpoint continues an earlier call's
exact ids (bridging), which vLLM's renderer has no notion of.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable

#: (text, request body) -> (content, tool calls as OpenAI dicts), or None for no call.
Reader = Callable[[str, dict], "tuple[str | None, list[dict]] | None"]


def is_vllm_engine(engine: Any) -> bool:
    """Whether ``engine`` is rldsl's vLLM engine (read without importing vLLM)."""
    return type(engine).__module__.startswith("rldsl.runtime.rollout.engines.vllm")


def vllm_tool_reader(name: str, tokenizer: Any) -> Reader:
    """vLLM's tool parser ``name`` as a :data:`Reader`. The parser is built per request (vLLM
    builds one per request too: it may keep streaming state)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    try:
        parser_cls = ToolParserManager.get_tool_parser(name)
    except KeyError:
        raise ValueError(f"vLLM has no tool parser {name!r} (rollout.tool_parser); it has: "
                         f"{', '.join(sorted(ToolParserManager.list_registered()))}") from None
    # a malformed call is a normal sample while a policy learns: vLLM's parsers log each one with
    # its traceback; the endpoint returns its text as content, as vLLM's server does, quietly
    logging.getLogger(parser_cls.__module__).setLevel(logging.CRITICAL)

    def read(text: str, body: dict) -> tuple[str | None, list[dict]] | None:
        # what the parsers read of a request: its tools and tool_choice (the messages are the
        # endpoint's to check; vLLM's stricter message types are not asked of the agent)
        request = ChatCompletionRequest(model=str(body.get("model")), messages=[], tools=body.get("tools"),
                                        **({"tool_choice": body["tool_choice"]} if body.get("tool_choice") else {}))
        info = parser_cls(tokenizer, request.tools).extract_tool_calls(text, request)
        if not info.tools_called or not info.tool_calls:
            return None
        calls = []
        for c in info.tool_calls:
            try:
                json.loads(c.function.arguments)
            except (TypeError, json.JSONDecodeError):
                return None  # not a call the agent could run: the text comes back as content
            calls.append({"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": c.function.arguments}})
        return info.content, calls

    return read
