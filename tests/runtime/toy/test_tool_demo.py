"""The tool-use demo's pieces: the 3-term sum task and its split, the calculator tool, the
tool tokenizer and chat template, the teacher's conversations and the cached warm start."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from rldsl.runtime.config import CALCULATOR_MAX_NEW_TOKENS, load_config
from rldsl.runtime.data.sources import default_tools, max_new_tokens
from rldsl.runtime.rollout.episodes.parsers import ToolCall, parse_tool_calls
from rldsl.runtime.rollout.episodes.tools import load_tools
from rldsl.runtime.toy.sources import CALCULATOR
from rldsl.runtime.toy import calculator as calc
from rldsl.runtime.toy import tool_warmup
from rldsl.runtime.toy.calculator import SumTask, TeacherMix, calculator, carry_free, teacher_trace
from rldsl.runtime.toy.tool_model import build_tool_tokenizer, tool_model_config
from rldsl.runtime.toy.tool_warmup import ToolWarmStartConfig, conversation_tokens, tool_warm_start


@pytest.fixture(scope="module")
def tok():
    return build_tool_tokenizer()


def numbers_of(prompt: str) -> tuple[int, ...]:
    assert prompt.endswith("=")
    return tuple(int(x) for x in prompt[:-1].split("+"))


# ----------------------------------------------------------------------------- the task

def test_split_is_fixed_exact_and_leaks_no_reordering() -> None:
    task = SumTask()
    held, train = task.heldout_examples(), task.train_examples()
    assert len(held) == 200 and len(train) == 20000
    assert [e.prompt for e in held] == [e.prompt for e in SumTask().heldout_examples()]  # fixed
    held_keys = {SumTask.key(numbers_of(e.prompt)) for e in held}
    assert not held_keys & {SumTask.key(numbers_of(e.prompt)) for e in train}
    # every ordering of a held-out multiset is held out (none is left for training)
    held_prompts = {e.prompt for e in held}
    for e in held:
        a, b, c = numbers_of(e.prompt)
        assert {SumTask.prompt(t) for t in [(a, b, c), (a, c, b), (b, a, c), (b, c, a), (c, a, b), (c, b, a)]} <= held_prompts
    assert all(e.answer == str(sum(numbers_of(e.prompt))) for e in held + train[:100])
    assert len({e.id for e in train}) == len(train)
    assert {e.prompt for e in task.validation_examples()} <= {e.prompt for e in train}


def test_carry_free_hand_cases() -> None:
    assert carry_free((58, 67, 9)) == "14"
    assert carry_free((12, 38, 57)) == "97"
    assert carry_free((11, 22, 33)) == "66"


# ----------------------------------------------------------------------------- the tool

@pytest.mark.parametrize("expression, value", [("12+34+56", "102"), ("12+34-5", "41"), ("-7", "-7"),
                                               (" 1 + 2 ", "3"), ("0", "0"), ("10-99", "-89")])
def test_calculator_adds_and_subtracts(expression, value) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", ["", "1+", "2*3", "2**100", "__import__('os')", "1/2", "1.5+1",
                                        "(1+2)", "1e9", "0x10", "1 2", "9" * 31, "1+" * 150 + "1"])
def test_calculator_rejects_anything_but_integer_sums(expression) -> None:
    with pytest.raises(ValueError):
        calculator(expression)


def test_calculator_rejects_non_text() -> None:
    with pytest.raises(TypeError):
        calculator(12)  # type: ignore[arg-type]


def test_calculator_schema_from_hints_and_docstring() -> None:
    f = get_json_schema(calculator)["function"]
    assert f["name"] == "calculator"
    assert f["parameters"]["properties"]["expression"]["type"] == "string"
    assert f["parameters"]["required"] == ["expression"]


# ----------------------------------------------------------------------------- tokenizer + template

def test_hermes_call_round_trips_through_tokens(tok) -> None:
    call = calc.hermes_call("calculator", {"expression": "12+34+56"})
    ids = tok(call, add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 + len("12+34+56")  # the boilerplate is whole tokens
    text = tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True)  # as the engine decodes
    assert text == call
    assert parse_tool_calls("hermes", text) == [ToolCall("calculator", {"expression": "12+34+56"})]


def test_the_task_fills_in_the_calculator() -> None:
    assert load_tools(CALCULATOR.tools) == [calc.calculator] and calc.TOOL_NAME == "calculator"
    cfg = load_config(None, ["data.task=calculator"])
    assert default_tools(cfg) == CALCULATOR.tools and max_new_tokens(cfg) == CALCULATOR_MAX_NEW_TOKENS
    assert default_tools(load_config(None, [])) is None
    assert default_tools(load_config(None, ["data.task=calculator", "rollout.tools=m:f"])) == "m:f"
    example = load_config(Path(__file__).parents[3] / "examples" / "tool_use.toml", [])
    assert example.data.task == "calculator" and example.train.steps == 60


def test_template_renders_tools_and_tool_messages(tok) -> None:
    messages = [{"role": "user", "content": "12+38+57="},
                {"role": "assistant", "content": calc.hermes_call("calculator", {"expression": "12+38"})},
                {"role": "tool", "name": "calculator", "content": "50"}]
    text = tok.apply_chat_template(messages, tools=[calculator], tokenize=False, add_generation_prompt=True)
    assert text == ('<|im_start|>system\n<tools>calculator</tools><|im_end|>\n'
                    '<|im_start|>user\n12+38+57=<|im_end|>\n'
                    '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
                    '{"expression": "12+38"}}\n</tool_call><|im_end|>\n'
                    '<|im_start|>user\n<tool_response>\n50\n</tool_response><|im_end|>\n'
                    '<|im_start|>assistant\n')
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and tok.unk_token_id not in ids
    # an assistant message with structured tool_calls renders the same Hermes text
    structured = dict(messages[1], content="", tool_calls=[
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12+38"}}}])
    assert tok.apply_chat_template(messages[:1] + [structured], tools=[calculator], tokenize=False) == \
        tok.apply_chat_template(messages[:2], tools=[calculator], tokenize=False)


def test_tokenizer_saves_and_loads_with_template(tok, tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast
    tok.save_pretrained(tmp_path)
    back = PreTrainedTokenizerFast.from_pretrained(tmp_path, local_files_only=True)
    text = calc.hermes_call("calculator", {"expression": "1+2"})
    assert back(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert back.chat_template == tok.chat_template and back.eos_token == "<|im_end|>"


# ----------------------------------------------------------------------------- teacher + warm start

def test_teacher_calls_are_well_formed_and_mostly_wrong() -> None:
    rng = random.Random(0)
    mix = TeacherMix()
    task = SumTask(num_train=500, num_validation=10)
    calls = right = copies = direct = 0
    for e in task.train_examples():
        trace = teacher_trace(numbers_of(e.prompt), mix, rng)
        if len(trace) == 1:
            direct += 1
            continue
        calls += 1
        body = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", trace[0]["content"], re.S)
        expression = json.loads(body.group(1))["arguments"]["expression"]
        assert trace[1]["content"] == calculator(expression)
        right += trace[1]["content"] == e.answer
        copies += trace[2]["content"] == trace[1]["content"]
    assert abs(calls / 500 - mix.call) < 0.06
    assert abs(right / calls - mix.right_expression) < 0.08
    assert abs(copies / calls - mix.copy_result) < 0.1


def test_loss_mask_covers_the_assistant_tokens_only(tok) -> None:
    messages = [{"role": "user", "content": "12+38+57="},
                {"role": "assistant", "content": calc.hermes_call("calculator", {"expression": "12+38+57"})},
                {"role": "tool", "name": "calculator", "content": "107"},
                {"role": "assistant", "content": "107"}]
    ids, mask = conversation_tokens(tok, messages, [calculator])
    trained = [i for i, m in zip(ids, mask) if m]
    eos = tok.eos_token_id
    assert tok.decode(trained, skip_special_tokens=False) == messages[1]["content"] + "<|im_end|>107<|im_end|>"
    assert trained.count(eos) == 2 and ids[-1] == eos
    assert tok.decode(ids) == tok.apply_chat_template(messages, tools=[calculator], tokenize=False).rstrip("\n")


def _small(tok):
    return tool_model_config(tok, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)


def test_warm_start_is_cached_by_its_settings(tok, tmp_path, monkeypatch) -> None:
    config = ToolWarmStartConfig(steps=2, batch_size=2, warmup_steps=1, task=SumTask(num_train=50, num_validation=5))
    path = tool_warm_start(config, model_config=_small(tok), cache=tmp_path)
    report = json.loads((path / "warm_start.json").read_text())
    assert report["steps"] == 2
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
    LlamaForCausalLM.from_pretrained(path, local_files_only=True)
    assert PreTrainedTokenizerFast.from_pretrained(path).chat_template

    def no_training(*args, **kwargs):
        raise AssertionError("trained again although the settings are cached")
    monkeypatch.setattr(tool_warmup, "_train", no_training)
    assert tool_warm_start(config, model_config=_small(tok), cache=tmp_path) == path
    # any other setting is another entry
    for other in (ToolWarmStartConfig(**{**config.__dict__, "seed": 1}),
                  ToolWarmStartConfig(**{**config.__dict__, "mix": TeacherMix(copy_result=0.9)})):
        assert tool_warmup.tool_warm_start_key(other, _small(tok)) != tool_warmup.tool_warm_start_key(config, _small(tok))
    assert tool_warmup.tool_warm_start_key(config, tool_model_config(tok)) != \
        tool_warmup.tool_warm_start_key(config, _small(tok))


def test_warm_start_never_reads_heldout_prompts(tok, tmp_path, monkeypatch) -> None:
    def forbidden(self):
        raise AssertionError("the warm start read the held-out prompts")
    monkeypatch.setattr(SumTask, "heldout_examples", forbidden)
    seen: list[tuple[int, ...]] = []
    real = tool_warmup.teacher_batch

    def spy(tokenizer, rows, mix, rng):
        seen.extend(rows)
        return real(tokenizer, rows, mix, rng)
    monkeypatch.setattr(tool_warmup, "teacher_batch", spy)
    task = SumTask(num_train=50, num_validation=5)
    tool_warm_start(ToolWarmStartConfig(steps=3, batch_size=4, warmup_steps=1, task=task),
                    model_config=_small(tok), cache=tmp_path)
    held = {SumTask.key(t) for t in task._split[0]}
    valid = {numbers_of(e.prompt) for e in task.validation_examples()}
    assert seen and not {SumTask.key(t) for t in seen} & held and not set(seen) & valid
