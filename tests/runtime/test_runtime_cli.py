"""rldsl run / rldsl plot through typer's CliRunner; training is replaced by a fake."""
from __future__ import annotations

import json
import sys
import types

import pytest
import typer
from typer.testing import CliRunner

from rldsl.errors import SpecError, Span
from rldsl.runtime.cli import register
from rldsl.runtime.config import RunConfig
from rldsl.runtime.records.run_dir import load_run_config, save_config

runner = CliRunner()


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


class FakeLoop(list):
    """The calls made to train(); ``error`` is raised by the next calls when set."""

    error: BaseException | None = None

    def __init__(self) -> None:
        super().__init__()
        self.restarts: list[bool] = []  # train()'s restart= of each call


@pytest.fixture
def calls(monkeypatch) -> FakeLoop:
    """Install a fake rldsl.runtime.run.loop whose train() records its arguments."""
    recorded = FakeLoop()
    fake = types.ModuleType("rldsl.runtime.run.loop")

    def train(spec, cfg, resume=None, restart=False):
        recorded.append((spec, cfg, resume))
        recorded.restarts.append(restart)
        if recorded.error is not None:
            raise recorded.error

    fake.train = train
    monkeypatch.setitem(sys.modules, "rldsl.runtime.run.loop", fake)
    return recorded


def invoke(app, *args):
    return runner.invoke(app, [str(a) for a in args])


def test_run_precedence_file_then_set_then_flags(app, calls, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("seed = 1\n[train]\nlr = 1e-3\nsteps = 50\n[rollout]\nn = 4\n")
    result = invoke(app, "run", "grpo", "--config", toml, "--set", "train.steps=20",
                    "--set", "train.lr=2e-4", "--steps", 7, "--seed", 9, "--model", "m/dir",
                    "--tensorboard", "--out", tmp_path / "r")
    assert result.exit_code == 0, result.output
    [(spec, cfg, resume)] = calls
    assert spec == "grpo" and resume is None
    assert isinstance(cfg, RunConfig)
    assert (cfg.train.steps, cfg.train.lr, cfg.seed, cfg.rollout.n) == (7, 2e-4, 9, 4)
    assert cfg.model.path == "m/dir" and cfg.log.tensorboard is True
    assert cfg.out == str(tmp_path / "r")


def test_run_defaults(app, calls):
    result = invoke(app, "run", "grpo")
    assert result.exit_code == 0, result.output
    assert calls[0][1] == RunConfig()


def test_bad_config_exits_2_without_traceback(app, calls):
    result = invoke(app, "run", "grpo", "--set", "train.lrr=1e-4")
    assert result.exit_code == 2
    assert "error: unknown config key 'train.lrr'" in result.stderr
    assert "did you mean 'train.lr'?" in result.stderr
    assert "Traceback" not in result.output
    assert calls == []


def test_bad_flag_value_and_bad_file_exit_2(app, calls, tmp_path):
    result = invoke(app, "run", "grpo", "--device", "gpu")
    assert result.exit_code == 2 and "device: Input should be 'cpu' or 'cuda'" in result.stderr
    result = invoke(app, "run", "grpo", "--config", tmp_path / "nope.toml")
    assert result.exit_code == 2 and "config file not found" in result.stderr
    result = invoke(app, "run", tmp_path / "missing.rl")
    assert result.exit_code == 2 and "spec file not found" in result.stderr
    result = invoke(app, "run")
    assert result.exit_code == 2 and "missing SPEC" in result.stderr
    assert calls == []


def test_traceback_flag_lets_the_error_through(app, calls):
    from rldsl.runtime.errors import ConfigError

    result = invoke(app, "run", "grpo", "--set", "nope=1", "--traceback")
    assert result.exit_code != 0 and isinstance(result.exception, ConfigError)


def test_spec_file_path_is_passed_through(app, calls, tmp_path):
    spec = tmp_path / "mine.rl"
    spec.write_text("algorithm mine extends grpo\n")
    assert invoke(app, "run", spec).exit_code == 0
    assert calls[0][0] == str(spec)


def test_resume_uses_the_saved_config(app, calls, tmp_path):
    run = tmp_path / "run"
    saved = RunConfig(seed=5, train={"steps": 100, "lr": 1e-4})
    save_config(saved, run, "algorithm x extends grpo\n")
    result = invoke(app, "run", "--resume", run, "--set", "train.steps=200")
    assert result.exit_code == 0, result.output
    [(spec, cfg, resume)] = calls
    assert spec == str(run / "spec.rl") and resume == run
    assert cfg.train.steps == 200 and cfg.train.lr == 1e-4 and cfg.seed == 5
    assert cfg.out == str(run)
    assert load_run_config(run) == saved  # the command itself writes nothing
    assert calls.restarts == [False]

    result = invoke(app, "run", "--resume", run, "--restart")  # start the folder over: passed on
    assert result.exit_code == 0, result.output
    assert calls.restarts == [False, True] and calls[-1][2] == run
    result = invoke(app, "run", "grpo", "--restart")
    assert result.exit_code == 2 and "--restart starts a run folder again from step 0" in result.stderr

    result = invoke(app, "run", "--resume", run, "--config", tmp_path / "x.toml")
    assert result.exit_code == 2 and "--config cannot be combined with --resume" in result.stderr
    result = invoke(app, "run", "--resume", tmp_path / "absent")
    assert result.exit_code == 2 and "run folder not found" in result.stderr
    result = invoke(app, "run", "--resume", run, "--out", tmp_path / "elsewhere")
    assert result.exit_code == 2 and "conflicts with --resume" in result.stderr


def test_errors_raised_by_training(app, calls):
    calls.error = SpecError("unknown baseline 'group_mena'", Span("a.rl", 4, 13, 10),
                                 hint="did you mean 'group_mean'?",
                                 source="\n\n\nbaseline    group_mena\n")
    result = invoke(app, "run", "grpo")
    assert result.exit_code == 2  # bad input, as `rldsl check` for an invalid spec
    assert result.stderr.splitlines() == [
        "a.rl:4:13: error: unknown baseline 'group_mena'",
        "   4 | baseline    group_mena",
        "     |             ^~~~~~~~~~",
        "     = help: did you mean 'group_mean'?"]
    calls.error = RuntimeError("out of prompts")
    result = invoke(app, "run", "grpo")
    assert result.exit_code == 1
    assert "error: RuntimeError: out of prompts" in result.stderr and "--traceback" in result.stderr
    assert "Traceback" not in result.output


def test_missing_training_loop(app, monkeypatch):
    monkeypatch.setitem(sys.modules, "rldsl.runtime.run.loop", None)
    result = invoke(app, "run", "grpo")
    assert result.exit_code == 1 and "training loop" in result.stderr


def _write_metrics(folder, scale):
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward_mean": scale * s, "eval/greedy_acc": s / 10}) + "\n"
        for s in range(1, 5)))


def test_plot_command(app, tmp_path):
    _write_metrics(tmp_path / "a", 0.1)
    _write_metrics(tmp_path / "b", 0.2)
    out = tmp_path / "both.png"
    result = invoke(app, "plot", tmp_path / "a", tmp_path / "b", "--out", out)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_command_errors(app, tmp_path):
    result = invoke(app, "plot", tmp_path / "nothing")
    assert result.exit_code == 2 and "not a run folder" in result.stderr
    result = invoke(app, "plot")
    assert result.exit_code == 2  # click: missing argument


def test_run_and_eval_declare_their_shared_options_once():
    """--reward, --tools and --env: one declaration (cli.SHARED_OPTIONS, made by cli.shared_option),
    each command saying only what it falls back to; both commands take them."""
    import inspect

    from rldsl.runtime import cli

    source = inspect.getsource(cli)
    for flag in ("--reward", "--tools", "--env"):
        assert f'typer.Option("{flag}"' not in source and f'typer.Option(\n        "{flag}"' not in source, flag
        assert flag in cli.SHARED_OPTIONS
        for command in (cli.run_command, cli.eval_command):
            assert f'shared_option("{flag}"' in inspect.getsource(command), (flag, command.__name__)
