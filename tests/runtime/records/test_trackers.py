"""log.report_to: TensorBoard, W&B (offline), Trackio (local store) and MLflow (file store) get
every metric of metrics.jsonl, the config and the spec; a resume continues the same tracker runs.
Everything is read back from the trackers' own local files."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rldsl.runtime.run import loop
from rldsl.runtime.config import load_config
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.records.metrics import MetricsLogger, read_metrics
from rldsl.runtime.records.trackers import TRACKERS, TrackerNames, check_trackers, numeric, open_trackers

from tracker_readers import (assert_same, jsonl_history, mlflow_history, renamed, tensorboard_history,
                             trackio_history, wandb_history)

ALL = list(TRACKERS)


@pytest.fixture(autouse=True)
def _local_trackers(monkeypatch, tmp_path):
    """Offline / local modes only, every tracker file under tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.mark.slow
def test_every_tracker_gets_every_metric_and_a_resume_continues_its_run(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "spec.rl").write_text("algorithm mine extends grpo\n")
    config = {"seed": 3, "rollout": {"n": 8, "temperature": 0.7}, "model": {"path": None}}
    first = [{"reward_mean": 0.25, "eval/greedy_acc": 0.5, "loss": -0.125},
             {"reward_mean": 0.5, "loss": 0.0625, "note": "text is not a metric"}]
    trackers = open_trackers(ALL, run_dir, config=config, spec_text="algorithm mine extends grpo\n",
                             project="proj")
    with MetricsLogger(run_dir, progress=False, trackers=trackers) as logger:
        for step, record in enumerate(first, start=1):
            logger.log(step, record)
    state = json.loads((run_dir / "trackers.json").read_text())
    # the run stopped after step 2's record, was killed, and resumes from its step-1 checkpoint
    trackers = open_trackers(ALL, run_dir, config=config, spec_text="algorithm mine extends grpo\n",
                             project="proj", resume_step=1)
    with MetricsLogger(run_dir, progress=False, resume_step=1, trackers=trackers) as logger:
        logger.log(2, {"reward_mean": 0.75, "loss": 0.25})
        logger.log(3, {"reward_mean": 1.0, "loss": 0.5})
    assert json.loads((run_dir / "trackers.json").read_text()) == state  # the same tracker runs
    want = jsonl_history(run_dir)
    assert want[2]["reward_mean"] == 0.75 and sorted(want) == [1, 2, 3]

    assert_same(tensorboard_history(run_dir), want, rel=1e-6)  # float32 events; step 2 purged and rewritten

    history, wb_config, ids = wandb_history(run_dir)
    assert ids == {state["wandb"]["id"]}
    assert history[3] == want[3] and history[1] == want[1] and history[2]["reward_mean"] == 0.75
    assert wb_config["seed"] == 3 and wb_config["spec"] == "algorithm mine extends grpo\n"

    from trackio.utils import TRACKIO_DIR  # read once, when trackio is first imported in this process
    history, tk_config, ids = trackio_history(TRACKIO_DIR, "proj")
    assert len(ids) == 1  # trackio resumed the run by its name
    assert {s: {k: v for k, v in h.items() if k in want[s]} for s, h in history.items()} == want
    assert tk_config["rollout.temperature"] == 0.7 and tk_config["spec"].startswith("algorithm mine")

    history, params, spec = mlflow_history(run_dir, state["mlflow"]["run_id"])
    assert_same(history, want)
    assert params["rollout.n"] == "8" and params["model.path"] == "null"
    assert spec == "algorithm mine extends grpo\n"


@pytest.mark.slow
def test_a_training_run_reports_to_trackers_and_resumes_them(model_dir, tmp_path):
    sets = [f"model.path={model_dir}", f"out={tmp_path / 'run'}", "rollout.prompts_per_step=4",
            "rollout.n=4", "train.steps=3", "eval.every=0", "checkpoint.every=1", "log.progress=false",
            "reward.name=reward_helpers:parity", "log.report_to=[wandb,mlflow]", "log.project=toy"]
    run = loop.train("grpo", load_config(None, sets), stop_after=2)
    run = loop.train("grpo", resume=run)
    want = jsonl_history(run)
    assert [s for s in want if "reward_mean" in want[s]] == [1, 2, 3]
    state = json.loads((run / "trackers.json").read_text())
    history, config, ids = wandb_history(run)
    assert ids == {state["wandb"]["id"]} and config["rollout"]["n"] == 4
    assert_same({s: history[s] for s in want}, want)
    history, _, spec = mlflow_history(run, state["mlflow"]["run_id"])
    assert_same(history, want)
    assert spec == (run / "spec.rl").read_text()


def test_unknown_or_missing_tracker_fails_before_the_run(monkeypatch, tmp_path, model_dir):
    with pytest.raises(ConfigError, match="report_to"):
        load_config(None, ["log.report_to=[comet]"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"wandb package is not installed: pip install 'rldsl\[wandb\]'"):
        check_trackers(["mlflow", "wandb"])
    cfg = load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'run'}", "log.report_to=[wandb]"])
    with pytest.raises(ConfigError, match="wandb package is not installed"):
        loop.train("grpo", cfg)
    assert not (tmp_path / "run").exists()  # nothing was started


# ------------------------------------------------------------------------------- names
DOCS = Path(__file__).resolve().parents[3] / "docs"
#: user-chosen parts of metric names, as awkward as a user may make them: eval set names (a file
#: stem or `name =`) and reward term labels (docs/rewards.md)
USER_PARTS = ["wtest", "gsm8k-test", "math 500", "v1.2", "2024_set", "a:b", "..", "é", "server_127.0.0.1",
              "rm_my-rm", "judge_localhost", "fmt_2", "x" * 240]


def documented_metric_names() -> set[str]:
    """Every name docs/runtime.md's Metrics section and metrics.py's constants spell, with each
    `<name>` / `<term>` / `<set>` placeholder filled with awkward user parts and pass@k for k = 1..64."""
    from rldsl.runtime.records import metrics
    import re
    text = (DOCS / "runtime.md").read_text()
    section = text[text.index("## Metrics"):text.index("### Experiment trackers")]  # the table, the eval sets
    names = set(re.findall(r"`([a-z][a-z_]*(?:/[<>a-z_@.]+)*)`", section))
    names |= {v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str) and "{" not in v}
    names |= {"async/staleness_mean", "async/staleness_max", "tool_calls/per_episode", "eval/sampled_tool_calls/errors"}
    out = set()
    for name in names:
        for part in USER_PARTS:
            out.add(name.replace("<term>", part).replace("<name>", part).replace("<set>", part))
    for part in USER_PARTS:
        out |= {metrics.REWARD_TERM_MEAN.format(term=part), metrics.REWARD_TERM_STD.format(term=part)}
        out |= {f"eval/{part}/{k}" for k in ("greedy_acc", "reward", "length", "truncated", "failed")}
        out |= {f"eval/{part}/pass@{k}" for k in (1, 2, 4, 8, 16, 32, 64)}
    return out


def assert_tracker_names_valid(names: set[str]) -> None:
    """Each tracker's rule gives each name a name the tracker takes, and no two the same name."""
    import re
    from mlflow.utils.validation import _validate_metric_name
    from rldsl.runtime.records.trackers import NAME_RULES, TRACKIO_RESERVED, TrackerNames

    for tracker in NAME_RULES:
        mapped = TrackerNames(tracker)
        out = [mapped(name) for name in sorted(names)]
        assert len(set(out)) == len(out), tracker
        for got in out:
            if tracker == "mlflow":
                _validate_metric_name(got)  # MLflow's own check (raises MlflowException)
                assert re.fullmatch(r"[/A-Za-z0-9_.\- ]{1,250}", got), got  # no colon: Windows servers
            elif tracker == "wandb":
                assert all(re.fullmatch(r"[_A-Za-z][_A-Za-z0-9]*", p) for p in got.split("/")), got
            elif tracker == "trackio":
                assert got not in TRACKIO_RESERVED and not got.startswith("__"), got
    assert TrackerNames("mlflow")("eval/wtest/pass@1") == "eval/wtest/pass_at_1"
    assert TrackerNames("wandb")("eval/2024_set/pass@4") == "eval/_2024_set/pass_at_4"
    assert TrackerNames("tensorboard")("eval/wtest/pass@1") == "eval/wtest/pass@1"


def test_every_documented_metric_name_meets_every_trackers_rules():
    names = documented_metric_names()
    assert {"eval/wtest/pass@1", "rewards/fmt_2/std", "time/rollout_s", "reward_mean"} <= names
    assert_tracker_names_valid(names)


def test_names_that_one_rule_makes_equal_stay_apart():
    names = TrackerNames("mlflow")
    assert [names(k) for k in ("eval/a@b/x", "eval/a_at_b/x", "eval/a@b/x")] == \
        ["eval/a_at_b/x", "eval/a_at_b/x_2", "eval/a_at_b/x"]


@pytest.mark.slow
def test_a_run_with_eval_sets_and_reward_terms_reaches_every_tracker(model_dir, tmp_path):
    """Every metrics.jsonl name of a real run (eval/<set>/pass@k, rewards/<term>/...) arrives at
    each tracker under its rule's name (MLflow refused `@`: the run crashed at step 0)."""
    (tmp_path / "wtest.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                                  for a, b in ((1, 2), (3, 4), (10, 5))))
    sets = [f"model.path={model_dir}", f"out={tmp_path / 'run'}", "rollout.prompts_per_step=2",
            "rollout.n=4", "train.steps=2", "eval.every=1", "eval.n=4", "checkpoint.every=0", "log.progress=false",
            f"eval.data=[{json.dumps(str(tmp_path / 'wtest.jsonl'))}]", f"log.report_to=[{','.join(ALL)}]",
            "log.project=names"]
    cfg = load_config(None, sets, flags={"reward.name": "reward_helpers:parity=0.5,addition=0.5"})
    run = loop.train("grpo", cfg)
    want = jsonl_history(run)
    names = set().union(*(v.keys() for v in want.values()))
    assert {"eval/wtest/pass@4", "rewards/parity/mean", "rewards/addition/std"} <= names
    assert_tracker_names_valid(names)

    state = json.loads((run / "trackers.json").read_text())
    history, _, _ = mlflow_history(run, state["mlflow"]["run_id"])
    assert_same(history, renamed(want, "mlflow"))
    assert "eval/wtest/pass_at_4" in history[2]
    assert_same(tensorboard_history(run), renamed(want, "tensorboard"), rel=1e-6)
    history, _, _ = wandb_history(run)
    assert_same({s: history[s] for s in want}, renamed(want, "wandb"))
    from trackio.utils import TRACKIO_DIR  # read once, when trackio is first imported in this process
    history, _, _ = trackio_history(TRACKIO_DIR, "names")
    assert_same({s: {k: v for k, v in h.items() if not k.startswith("_")} for s, h in history.items()},
                renamed(want, "trackio"))


@pytest.mark.slow
def test_a_tool_run_of_the_real_shaped_model_reaches_every_tracker_and_resumes(real_model, tmp_path):
    """The Qwen2.5-shaped fixture (its real ChatML + tools template), a tool, an eval.data set and
    every tracker: each metrics.jsonl name of the run -- the tool-call and eval/<set>/pass@k ones
    among them -- reaches each tracker under its rule's name, through a stop and a resume."""
    from real_tools import WEATHER

    rows = [{"prompt": f"What is the weather in {c}?", "answer": w} for c, w in list(WEATHER.items())[:4]]
    data = tmp_path / "weather.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [f"model.path={real_model('qwen2.5', warm=True)}", f"out={tmp_path / 'run'}", f"data.path={data}",
            "data.eval_size=0", f"eval.data=[{json.dumps(str(data))}]", "eval.every=1", "eval.n=2",
            "eval.samples=0", "rollout.prompts_per_step=2", "rollout.n=2", "train.steps=2",
            "rollout.max_new_tokens=40", "rollout.max_turns=2", "checkpoint.every=1", "log.progress=false",
            "reward.name=reward_helpers:answered", "rollout.tools=real_tools:get_weather",
            f"log.report_to=[{','.join(ALL)}]", "log.project=real"]
    run = loop.train("grpo", load_config(None, sets), stop_after=1)
    run = loop.train("grpo", resume=run)
    want = jsonl_history(run)
    assert [s for s in want if "reward_mean" in want[s]] == [1, 2]
    names = set().union(*(v.keys() for v in want.values()))
    assert {"eval/weather/pass@2", "tool_calls/per_episode", "rewards/answered/mean"} <= names, sorted(names)

    state = json.loads((run / "trackers.json").read_text())
    history, _, _ = mlflow_history(run, state["mlflow"]["run_id"])
    assert_same(history, renamed(want, "mlflow"))
    assert_same(tensorboard_history(run), renamed(want, "tensorboard"), rel=1e-6)
    history, _, ids = wandb_history(run)
    assert ids == {state["wandb"]["id"]}
    assert_same({s: history[s] for s in want}, renamed(want, "wandb"))
    from trackio.utils import TRACKIO_DIR  # read once, when trackio is first imported in this process
    history, _, _ = trackio_history(TRACKIO_DIR, "real")
    assert_same({s: {k: v for k, v in h.items() if not k.startswith("_")} for s, h in history.items()},
                renamed(want, "trackio"))
