"""Runs with tools and environments on the real-shaped fixture (tests/fixtures/README.md): a
byte-level BPE tokenizer with Qwen2.5's or Llama 3.1's released chat template. What the
embedded toy hides: a template that renders a system prompt of its own, adds a BOS and puts the
tools into the first user turn -- the prompt must be templated exactly once."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import real_model as fixture
from real_tools import WEATHER
from tool_helpers import SPECIAL_MARKER_CALL, special_marker_episode
from rldsl.runtime.run import loop
from rldsl.runtime.config import load_config
from rldsl.runtime.rollout.episodes.parsers import ToolCall, parse_tool_calls

FAMILIES = sorted(fixture.FAMILIES)


def test_the_templates_are_the_released_ones() -> None:
    """Byte for byte (README.md names their sources), and the tokenizers hold the real tokens."""
    for fam in fixture.FAMILIES.values():
        text = fixture.chat_template(fam)
        assert "tools" in text and "add_generation_prompt" in text
    tok = fixture.build_tokenizer("qwen2.5")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    ids = tok("<tool_call>x</tool_call>", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[0] == "<tool_call>"  # an added token, whole
    llama = fixture.build_tokenizer("llama3.1")
    assert llama("hi")["input_ids"][0] == llama.convert_tokens_to_ids("<|begin_of_text|>")  # adds its BOS


@pytest.mark.parametrize("family", FAMILIES)
def test_the_parsers_read_each_familys_calls(family) -> None:
    fam = fixture.family(family)
    text = fixture.tool_call_text(fam, "get_weather", {"city": "Oslo"})
    assert parse_tool_calls(fam.tool_parser, text) == [ToolCall("get_weather", {"city": "Oslo"})]
    assert parse_tool_calls(fam.tool_parser, "snow") == []
    tagged = '<|python_tag|>{"name": "f", "arguments": {"a": 1}}'
    assert parse_tool_calls("llama3_json", tagged) == [ToolCall("f", {"a": 1})]
    bad = parse_tool_calls("llama3_json", '{"name": "f", "parameters": ')
    assert len(bad) == 1 and "not valid JSON" in bad[0].message


def _rows(kind: str) -> list[dict]:
    cities = list(WEATHER)[:4]
    if kind == "string prompts":
        return [{"prompt": f"What is the weather in {c}?", "answer": WEATHER[c]} for c in cities]
    return [{"prompt": [{"role": "system", "content": "Answer in one word."},
                        {"role": "user", "content": f"What is the weather in {c}?"}], "answer": WEATHER[c]}
            for c in cities]


def _run(model: Path, tmp_path: Path, rows: list[dict], *extra: str) -> list[dict]:
    data = tmp_path / "weather.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"model.path={model}", f"out={tmp_path / 'run'}", f"data.path={data}",
                             "data.eval_size=0", "rollout.prompts_per_step=2", "rollout.n=2", "train.steps=1",
                             "rollout.max_new_tokens=8", "rollout.max_turns=2", "eval.every=0", "eval.samples=0",
                             "checkpoint.every=0", "log.progress=false", "log.samples_per_step=2",
                             "reward.name=exact", *extra])
    run = loop.train("grpo", cfg)
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["string prompts", "messages prompts"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_run_templates_each_prompt_once(real_model, tmp_path, family, kind) -> None:
    """--tools under data.chat_template=auto: the episode starts from the row's own messages and
    the engine is fed the template's rendering of them with the tools, once."""
    from transformers import AutoTokenizer

    from rldsl.runtime.rollout.episodes.tools import tool_schema
    from real_tools import get_weather

    model = real_model(family)
    rows = _rows(kind)
    samples = _run(model, tmp_path, rows, "rollout.tools=real_tools:get_weather",
                   f"rollout.tool_parser={fixture.family(family).tool_parser}")
    tok = AutoTokenizer.from_pretrained(model)
    by_question = {json.dumps(r["prompt"]): r for r in rows}
    assert samples
    for s in samples:
        first = [{k: v for k, v in m.items() if k != "trained"} for m in s["messages"][:len(rows[0]["prompt"])
                                                                                 if kind != "string prompts" else 1]]
        row = by_question[json.dumps(first if kind != "string prompts" else first[0]["content"])]
        want = [{"role": "user", "content": row["prompt"]}] if kind == "string prompts" else row["prompt"]
        assert s["prompt"] == tok.apply_chat_template(want, tools=[tool_schema(get_weather)], tokenize=False,
                                                      add_generation_prompt=True)
        header = "<|im_start|>system" if family == "qwen2.5" else "<|start_header_id|>system"
        assert s["prompt"].count(header) == 1 and "<|im_start|>user\n<|im_start|>" not in s["prompt"]


class Recorder:
    """An environment that keeps every row its reset receives and ends each episode at once."""

    rows: list[dict] = []

    def reset(self, row: dict) -> list[dict]:
        Recorder.rows.append(row)
        prompt = row["prompt"]
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def step(self, assistant_message: dict):
        return [], 1.0, True


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["string prompts", "messages prompts"])
def test_an_environment_receives_the_rows_own_prompt(real_model, tmp_path, monkeypatch, kind) -> None:
    """--env: reset(row) gets the data row's prompt as written (a string or its messages), never
    the templated text, and data.system_prompt as row["system"]."""
    monkeypatch.setattr(Recorder, "rows", [])
    rows = _rows(kind)
    _run(real_model("qwen2.5"), tmp_path, rows, f"rollout.env={__name__}:Recorder", "reward.name=env",
         "data.system_prompt=Be brief.", f'eval.data=["{tmp_path / "weather.jsonl"}"]', "eval.every=1")
    assert len(Recorder.rows) > 2 * 2  # the step's 2 x 2 episodes, and the eval set's
    for row in Recorder.rows:  # training and the eval.data set's episodes alike, with the row's answer
        assert row["prompt"] in [r["prompt"] for r in rows] and row["system"] == "Be brief."
        assert row["answer"] == next(r["answer"] for r in rows if r["prompt"] == row["prompt"])


@pytest.mark.slow
def test_eval_of_a_tool_run_scores_its_episodes(real_model, tmp_path) -> None:
    """`rldsl eval RUN` reads the run's tools: the warm-started model calls get_weather, reads the
    tool's answer and answers, so each greedy episode ends with an answer (reward `answered` 1);
    single-turn, its completion is the unanswered call (0). `--tools` does the same for a model
    folder."""
    from typer.testing import CliRunner

    from rldsl.cli import app

    rows = _rows("string prompts")
    data = tmp_path / "weather.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = real_model("qwen2.5", warm=True)
    cfg = load_config(None, [f"model.path={model}", f"out={tmp_path / 'run'}", f"data.path={data}",
                             "data.eval_size=0", "rollout.prompts_per_step=2", "rollout.n=2", "train.steps=1",
                             "train.lr=1e-12", "rollout.max_new_tokens=40", "rollout.max_turns=2", "eval.every=0",
                             "eval.samples=0", "checkpoint.every=1", "log.progress=false",
                             "reward.name=reward_helpers:answered", "rollout.tools=real_tools:get_weather"])
    run = loop.train("grpo", cfg)

    def greedy(*args: str) -> float:
        out = tmp_path / "m.json"
        res = CliRunner().invoke(app, ["eval", *args, "--data", str(data), "--n", "0", "--out", str(out)])
        assert res.exit_code == 0, res.output
        return json.loads(out.read_text())["eval/weather/greedy_acc"]

    assert greedy(str(run)) == 1.0  # the run's tools: episodes that end in an answer
    flags = ["--reward", "reward_helpers:answered", "--max-new-tokens", "40"]
    assert greedy(str(model), *flags) == 0.0  # a model folder, no tools: the call is the answer
    assert greedy(str(model), *flags, "--tools", "real_tools:get_weather") == 1.0


class Nudge:
    """Answers each assistant turn with a user message; done after the second."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message: dict):
        self.turns += 1
        return ([], 1.0, True) if self.turns == 2 else ([{"role": "user", "content": "and tomorrow?"}], None, False)


@pytest.mark.parametrize("family", FAMILIES)
def test_episode_tokens_are_the_models_then_the_templates_delta(family, tmp_path) -> None:
    """A 2-turn episode on each family's released template, the model's first turn ending in a
    newline and a space (Llama 3.1's template trims it): the model's ids are kept as sampled
    (mask 1), the environment's are the template's delta after them (mask 0), and the whole
    decodes to the template's rendering up to that turn's text."""
    from test_episodes import ScriptedEngine

    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.models.loading import load_tokenizer
    from rldsl.runtime.rollout.episodes.runner import run_episodes

    fixture.build_tokenizer(family).save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)  # as a run loads it: Llama 3.1 pads with its reserved pad token
    assert tok.pad_token_id != tok.eos_token_id
    turns = ["sunny \n ", "rain"]
    batch = run_episodes(ScriptedEngine(tok, turns), tok, [{"prompt": "Weather in Oslo?", "answer": ""}], [Nudge()],
                         SamplingParams(n=1, max_new_tokens=8), max_turns=3)
    assert batch.finish_reason == ["stop"]
    n = int(batch.response_attention[0].sum())
    ids, mask = batch.response_ids[0, :n].tolist(), batch.response_mask[0, :n].tolist()
    said = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in turns]
    assert ids[:len(said[0])] == said[0] and ids[-len(said[1]):] == said[1]
    gap = ids[len(said[0]):-len(said[1])]
    assert mask == [1] * len(said[0]) + [0] * len(gap) + [1] * len(said[1])
    conv = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": turns[0]},
            {"role": "user", "content": "and tomorrow?"}]
    after = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert tok.decode(gap) in after and after.endswith(tok.decode(gap))  # the delta: closing, user turn, next header
    assert "and tomorrow?" in tok.decode(gap)


def test_tool_calls_marked_by_special_tokens_are_parsed_on_the_hf_engine() -> None:
    """<tool_call> and </tool_call> special tokens (fixture.build_tokenizer(special_tool_markers=True)),
    the HF engine: the calls are read (special_marker_episode)."""
    from rldsl.runtime.rollout.engines.hf import HFEngine

    tok = fixture.build_tokenizer("qwen2.5", special_tool_markers=True)
    special_marker_episode(HFEngine(fixture.scripted_model("qwen2.5", tok, SPECIAL_MARKER_CALL), tok))

@pytest.mark.slow
def test_an_agent_of_the_warm_model_trains_on_its_exact_calls(real_model, tmp_path) -> None:
    """An openai-client tool loop (agent_helpers.weather_agent) drives the warm Qwen2.5-shaped
    model through the run's endpoint: its calls are bridged over Qwen2.5's released template (one
    row per episode, no prefix break, no error), the tool answers, and the trained tokens of each
    sample are exactly the ids the engine sampled, call by call."""
    from agent_helpers import tool_answer
    from real_tools import get_weather
    from rldsl.runtime.records.metrics import read_metrics

    data = tmp_path / "weather.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows("string prompts")))
    cfg = load_config(None, [f"model.path={real_model('qwen2.5', warm=True)}", f"out={tmp_path / 'run'}",
                             f"data.path={data}", "data.eval_size=0", "rollout.prompts_per_step=2", "rollout.n=2",
                             "train.steps=2", "rollout.max_new_tokens=40", "eval.every=0", "eval.samples=0",
                             "checkpoint.every=0", "log.progress=false", "log.samples_per_step=4",
                             "reward.name=reward_helpers:answered", "rollout.agent=agent_helpers:weather_agent"])
    run = loop.train("grpo_tis", cfg)
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["agent/calls"] >= 1 and r["agent/errors"] == 0 and r["agent/prefix_breaks"] == 0
               and r["agent/rows_per_episode"] == 1 and r["reward_errors"] == 0 for r in steps)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    # each tool answer is the tool run on the arguments the endpoint parsed from that call: the
    # agent's calls are seeded by arrival, so a sampled bad name or argument may occur (the loop runs
    # get_weather whatever the name)
    calls = [c["function"] for s in samples for m in s["messages"] if m["role"] == "assistant"
             for c in m.get("tool_calls", [])]
    tool_texts = [m["content"] for s in samples for m in s["messages"] if m["role"] == "tool"]
    assert len(calls) == len(tool_texts) and any(t in WEATHER.values() for t in tool_texts)
    assert tool_texts == [tool_answer(get_weather, c["arguments"]) for c in calls]
    for s in samples:
        agent = s["agent"]
        assert agent["rows"] == 1 and agent["error"] is None and agent["calls"]
        trained = [i for i, m in zip(agent["ids"], agent["trained"]) if m]
        assert trained == [i for c in agent["calls"] for i in c["completion_ids"]]
        assert s["prompt"].count("<|im_start|>user") == 1  # the row's prompt, templated once, by the endpoint


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["synchronous", "async K=1"])
def test_the_warm_model_calls_its_tool_in_training_steps(real_model, tmp_path, mode) -> None:
    """The tool warm start in a run, synchronous and one step off-policy: every step's episodes
    call get_weather in well-formed calls, the tool answers, nothing fails."""
    from rldsl.runtime.records.metrics import TOOL_CALLS_PER_EPISODE, TOOL_CALLS_WELL_FORMED, read_metrics

    data = tmp_path / "weather.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows("string prompts")))
    extra = ["rollout.max_staleness=1"] if mode == "async K=1" else []
    cfg = load_config(None, [f"model.path={real_model('qwen2.5', warm=True)}", f"out={tmp_path / 'run'}",
                             f"data.path={data}", "data.eval_size=0", "rollout.prompts_per_step=2", "rollout.n=2",
                             "train.steps=2", "rollout.max_new_tokens=40", "rollout.max_turns=2", "eval.every=0",
                             "eval.samples=0", "checkpoint.every=0", "log.progress=false", "log.samples_per_step=2",
                             "reward.name=reward_helpers:answered", "rollout.tools=real_tools:get_weather", *extra])
    run = loop.train("grpo_tis", cfg)
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r[TOOL_CALLS_PER_EPISODE] >= 1 and r[TOOL_CALLS_WELL_FORMED] == 1 and r["reward_errors"] == 0
               for r in steps)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    tool_texts = [m["content"] for s in samples for m in s["messages"] if m["role"] == "tool"]
    assert tool_texts and all(t in WEATHER.values() for t in tool_texts)
