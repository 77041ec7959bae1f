"""The table of prompt sources (runtime/data/sources.py): every kind answers the same questions
through its row, a new kind is one registered row, and ``rldsl eval`` builds its reward and
engine with the run's recipe."""
from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from rldsl.runtime.config import load_config
from rldsl.runtime.data.datasets import Example
from rldsl.runtime.data.sources import (BUILT_IN, HELDOUT_ROWS, SOURCES, Rows, Source, default_reward, default_tools,
                                        heldout_count, max_new_tokens, register, reward_origin, source_of,
                                        system_prompt)
from rldsl.runtime.run import eval_command
from rldsl.runtime.run.sources import prompts_of


@pytest.mark.parametrize("overrides, kind, reward, tokens, tools", [
    ([], "addition", "addition", 4, None),
    (["data.task=calculator"], "calculator", "addition", 24, "rldsl.runtime.toy.calculator:calculator"),
    (["data.task=calculator", "rollout.tools=m:f"], "calculator", "addition", 24, "m:f"),
    (["data.path=train.jsonl"], "file", "exact", 1024, None),
    (["data.path=reasoning_gym:leg_counting"], "reasoning_gym", "reasoning_gym", 1024, None),
    (["rollout.env=verifiers:sum"], "verifiers", "env", 1024, None),  # its tasks are the rows
    (["rollout.env=openenv:x"], "addition", "env", 4, None),  # an environment's own reward, the task's rows
    (["data.path=train.jsonl", "rollout.agent=m:f"], "file", "env", 1024, None),  # the agent's return value
])
def test_every_kind_answers_through_its_row(overrides, kind, reward, tokens, tools):
    cfg = load_config(None, overrides)
    assert (source_of(cfg).name, default_reward(cfg), max_new_tokens(cfg), default_tools(cfg)) == \
        (kind, reward, tokens, tools)


def test_the_held_out_size_and_the_system_prompt_are_said_once():
    assert heldout_count(load_config(None, [])) == HELDOUT_ROWS == 200
    assert heldout_count(load_config(None, ["data.eval_size=7"])) == 7
    assert system_prompt(load_config(None, ["data.path=a.jsonl"])) is None
    assert system_prompt(load_config(None, ["data.path=a.jsonl", "data.system_prompt=Be brief."])) == "Be brief."
    assert system_prompt(load_config(None, ["data.path=reasoning_gym:x", "data.system_prompt="])) is None


def test_rldsl_evals_default_reward_is_the_sets_sources_shared_one():
    cfg = load_config(None, [])
    assert default_reward(cfg, ["reasoning_gym:a", "reasoning_gym:b"]) == "reasoning_gym"
    assert default_reward(cfg, ["reasoning_gym:a", "b.jsonl"]) == "exact"
    assert default_reward(cfg, ["b.jsonl"]) == "exact"


def test_a_new_kind_of_source_is_one_registered_row(monkeypatch):
    """What a new kind declares reaches the run: its rows and held-out split, reward, tools,
    max_new_tokens, system prompt, and the run-start line naming its reward."""
    monkeypatch.setitem(SOURCES, "demo", None)  # the row leaves the table after the test
    rows = [Example(id=i, prompt=f"q{i}", answer=str(i)) for i in range(3)]
    register(Source("demo", "demo rows", claims=lambda cfg: (cfg.data.path or "").startswith("demo:"),
                    rows=lambda cfg: Rows(rows[:2], rows[2:], ["2 demo rows"]), reward="contains",
                    max_new_tokens=9, tools="m:f", system_prompt=lambda: "Think.", precedence=1))
    cfg = load_config(None, ["data.path=demo:x"])
    assert source_of(cfg).name == "demo" and reward_origin(cfg) == "demo rows"
    assert (default_reward(cfg), max_new_tokens(cfg), default_tools(cfg), system_prompt(cfg)) == \
        ("contains", 9, "m:f", "Think.")
    notes: list[str] = []
    source, held = prompts_of(cfg, source_of(cfg), None, notes.append)
    assert [e.prompt for e in source.examples] == ["q0", "q1"] and [e.prompt for e in held] == ["q2"]
    assert notes == ["2 demo rows"] and source.name == "demo:x"


def test_rldsl_eval_builds_its_reward_and_engine_with_the_recipe(model_dir, tmp_path, monkeypatch):
    """`rldsl eval` scores with the recipe's reward (resolve.reward_fn: reward.answer_format and
    reward.workers apply) and samples with the recipe's engine (recipe.rollout_engine:
    rollout.engine, model.dtype, model.compile apply), not a reward and an HF engine of its own."""
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in (10, 20)))
    built: dict[str, object] = {}
    real_engine, real_reward = eval_command.rollout_engine, eval_command.reward_fn

    def engine(cfg, path, device, **kw):
        built["engine"] = (cfg.rollout.engine, cfg.model.compile, device, str(path))
        return real_engine(cfg, path, device, **kw)

    def reward(cfg):
        built["reward"] = cfg.reward.name
        return real_reward(cfg)

    monkeypatch.setattr(eval_command, "rollout_engine", engine)
    monkeypatch.setattr(eval_command, "reward_fn", reward)
    out = tmp_path / "metrics.json"
    eval_command.evaluate_target(model_dir, [data], n=0, max_new_tokens=2, out=out)
    assert built == {"engine": ("hf", False, "cpu", str(model_dir)), "reward": "exact"}
    assert "eval/eval/greedy_acc" in json.loads(out.read_text())


def test_rldsl_eval_of_a_run_samples_with_the_runs_engine_and_compile_settings(model_dir, tmp_path, monkeypatch):
    """A run folder is evaluated with its own recipe: its config's ``rollout.engine`` and
    ``model.compile`` (here vllm, compiled: not the defaults, hf and eager) reach the engine
    ``rldsl eval`` builds. The checkpoint's export is stood in for by the model folder and the
    engine is stopped before it loads (no vLLM needed): what is checked is what it is asked for."""
    from rldsl.runtime.models.loading import load_tokenizer
    from rldsl.runtime.records.run_dir import save_config
    from rldsl.runtime.run.eval_target import EvalTarget

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    save_config(load_config(None, ["rollout.engine=vllm", "model.compile=true", f"model.path={model_dir}"]), run)
    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")

    def exported(self, step=None):  # the run's checkpoint, exported: the model folder stands in
        self.folder, self.tokenizer = model_dir, load_tokenizer(model_dir)
        return self

    asked: list[tuple] = []

    class Stop(Exception):
        pass

    def engine(cfg, path, device, **kw):
        asked.append((cfg.rollout.engine, cfg.model.compile, str(path)))
        raise Stop

    monkeypatch.setattr(EvalTarget, "load", exported)
    monkeypatch.setattr(eval_command, "rollout_engine", engine)
    with pytest.raises(Stop):
        eval_command.evaluate_target(run, [data], n=0, max_new_tokens=2)
    assert asked == [("vllm", True, str(model_dir))]


def test_a_new_kind_of_source_gives_its_eval_sets_and_every_rollout_path_its_system_prompt(monkeypatch, tokenizer):
    """A kind's ``eval_rows`` makes the evaluation sets of its paths (eval.data, rldsl eval --data)
    and its system prompt reaches them, the training prompts and the episodes' rows alike: one
    decision (data/sources.py ``system_prompt``), read by every rollout path."""
    from rldsl.runtime.rewards.functions import RewardFn
    from rldsl.runtime.rollout.episodes.runner import EpisodeRunner
    from rldsl.runtime.run.eval_sets import load_sets

    monkeypatch.setitem(SOURCES, "demo", None)  # the row leaves the table after the test
    row = [Example(id=0, prompt="q0", answer="0")]
    asked: list[tuple] = []

    def eval_rows(cfg, path, count, exclude):
        asked.append((path, count, exclude))
        return {"easy": row, "hard": row}, f"{path}: two sets"

    register(Source("demo", "demo rows", claims=lambda cfg: (cfg.data.path or "").startswith("demo:"),
                    rows=lambda cfg: Rows(row, []), reward="exact", system_prompt=lambda: "Think.",
                    eval_rows=eval_rows, precedence=1))
    cfg = load_config(None, ["data.chat_template=off"])  # plain format: the system prompt, a blank line, the question
    notes: list[str] = []
    sets = load_sets("demo:x", cfg, RewardFn("exact"), tokenizer, count=3, name="d", note=notes.append)
    assert [s.name for s in sets] == ["d/easy", "d/hard"] and notes == ["demo:x: two sets"]
    assert asked == [("demo:x", 3, None)]
    assert [e.prompt for s in sets for e in s.examples] == ["Think.\n\nq0"] * 2
    training = load_config(None, ["data.path=demo:x", "data.chat_template=off"])
    source, _ = prompts_of(training, source_of(training), tokenizer)
    assert [e.prompt for e in source.examples] == ["Think.\n\nq0"]
    tools = ["data.path=demo:x", "rollout.tools=rldsl.runtime.toy.calculator:calculator"]
    assert EpisodeRunner.from_config(load_config(None, tools), None).system_prompt == "Think."
    given = load_config(None, [*tools, "data.system_prompt="])  # set ("": none), it wins
    assert EpisodeRunner.from_config(given, None).system_prompt is None


RUNTIME = Path(__file__).resolve().parents[3] / "runtime"


def _calls(name: str) -> list[str]:
    """``file:line`` of every call of ``name`` in the runtime outside data/sources.py."""
    pattern = re.compile(rf"(?<![\w.]){name}\(")
    return sorted(f"{p.relative_to(RUNTIME)}:{i}" for p in RUNTIME.rglob("*.py") if p.name != "sources.py"
                  or p.parent.name != "data" for i, line in enumerate(p.read_text().splitlines(), 1)
                  if pattern.search(line.split("#")[0]) and not line.lstrip().startswith("def "))


def test_the_run_asks_the_table_for_its_source_once_in_the_plan():
    """The plan binds the source to the config (``Plan.source``, carried as ``Run.source``); no
    reader of the run's rows, prompts, model, checks or rows' tasks asks the table again."""
    assert [c.split(":")[0] for c in _calls("source_of")] == ["run/plan.py"]


def test_the_built_in_kinds_are_registered_from_one_list_not_by_imports():
    """No module adds its row to the table when imported: the built-in rows are BUILT_IN's, in
    its order, whichever module was imported first."""
    assert _calls("register") == []
    source_of(load_config(None, []))  # the table, whole
    named = [getattr(importlib.import_module(m), n) for m, names in BUILT_IN for n in names]
    assert [s.name for s in named] == ["file", "addition", "calculator", "reasoning_gym", "shapes", "verifiers"]
    assert all(SOURCES[s.name] is s for s in named)
