"""The stand-in episode pieces the demo uses: the Hermes parser, tools in a separate process
(errors, time limit, output limit, non-text results), ToolEnv and the config check."""
from __future__ import annotations


import pytest

from rldsl.runtime.config import load_config
from rldsl.runtime.data.sources import settle, source_of
from rldsl.runtime.rollout.episodes.env import ToolEnv
from rldsl.runtime.rollout.episodes.parsers import ToolCall, ToolCallError, parse_tool_calls
from rldsl.runtime.rollout.episodes.tool_worker import TRUNCATED
from rldsl.runtime.rollout.episodes.tools import ToolPool, load_tools
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.rollout.multi_turn import check_tools
from rldsl.runtime.toy.calculator import calculator, hermes_call


def test_hermes_parser() -> None:
    text = hermes_call("calculator", {"expression": "1+2"}) + ' and <tool_call>{"name": "x", "arguments": {}}</tool_call>'
    assert parse_tool_calls("hermes", text) == [ToolCall("calculator", {"expression": "1+2"}), ToolCall("x", {})]
    assert parse_tool_calls("hermes", "42") == []
    bad = parse_tool_calls("hermes", "<tool_call>{not json}</tool_call>")
    assert len(bad) == 1 and isinstance(bad[0], ToolCallError) and "JSON" in bad[0].message
    assert isinstance(parse_tool_calls("hermes", '<tool_call>{"arguments": {}}</tool_call>')[0], ToolCallError)
    assert isinstance(parse_tool_calls("hermes", '<tool_call>{"name": "a"')[-1], ToolCallError)


@pytest.mark.slow
def test_tools_run_apart_with_limits() -> None:
    from tool_helpers import boom, chatty, opaque, sleepy, structured
    runner = ToolPool()
    try:
        out = runner.run_many([(boom, {"x": 1}), (chatty, {"n": 5000}), (structured, {"n": 3}), (opaque, {"n": 1}),
                               (calculator, {"expression": "2*3"}), (calculator, {"expression": "2+3"})],
                              timeout_s=30, max_output_chars=100)
        assert out[0] == "error: RuntimeError: boom 1"
        assert out[1] == "x" * 100 + TRUNCATED
        assert out[2] == '{"n": 3, "set": [1, 2]}' and out[3] == "{1, 2}"
        assert out[4].startswith("error: ValueError: not a sum of integers") and out[5] == "5"
        hung = runner.run_many([(sleepy, {"seconds": 60})], timeout_s=1.0, max_output_chars=100)
        assert hung == ["error: the tool took longer than 1 s"]
        assert runner.run_many([(calculator, {"expression": "1+1"})], timeout_s=30, max_output_chars=100) == ["2"]
    finally:
        runner.close()


def test_tool_env_answers_every_call() -> None:
    env = ToolEnv([calculator], max_tool_calls=2)
    assert env.reset({"prompt": "1+2+3="}) == [{"role": "user", "content": "1+2+3="}]
    assert env.step({"role": "assistant", "content": "6"}).done
    calls = hermes_call("calculator", {"expression": "1+2"}) + hermes_call("nope", {}) + \
        "<tool_call>{bad</tool_call>" + hermes_call("calculator", {"expression": "3"})
    result = env.step({"role": "assistant", "content": calls})
    assert not result.done and [m["role"] for m in result.messages] == ["tool"] * 4
    texts = [m["content"] for m in result.messages]
    assert texts[0] == "3" and "unknown tool 'nope'" in texts[1]
    assert texts[2].startswith("error:") and "at most 2 tool calls" in texts[3]


def test_bad_tools_fail_before_the_model_loads() -> None:
    with pytest.raises(ConfigError, match="cannot import"):
        check_tools(load_config(None, ["rollout.tools=no_such_module:f"]))
    with pytest.raises(ConfigError, match="no function"):
        check_tools(load_config(None, ["rollout.tools=tool_helpers:missing"]))
    with pytest.raises(ConfigError, match="module:function"):
        load_tools("tool_helpers")
    assert [f.__name__ for f in load_tools("tool_helpers:boom, tool_helpers:chatty")] == ["boom", "chatty"]
    calculator = load_config(None, ["data.task=calculator"])
    check_tools(settle(calculator, source_of(calculator))[0])  # the calculator's tools are filled in and load
