"""One exit-code scheme for every command: 0 ok, 1 a run failed, 2 usage or bad input, 130
interrupted (rldsl.cli_errors; docs/errors.md). The table runs each command on a bad input."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rldsl.cli import app
from rldsl.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK

runner = CliRunner()
HERE = Path(__file__).parent


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "bad.rl").write_text("algorithm bad\n  baseline group_mena\n")
    (tmp_path / "notrl.yaml").write_text("model:\n  path: x\n")
    (tmp_path / "raises.py").write_text("def boom(prompt, completion, answer):\n    raise ZeroDivisionError('no')\n")
    (tmp_path / "exits.py").write_text("import sys\n\ndef bye(prompt, completion, answer):\n    sys.exit(0)\n\n"
                                       "def three(prompt, completion, answer):\n    raise SystemExit(3)\n")
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "norun").mkdir()
    (tmp_path / "afile").write_text("a user's file\n")
    (tmp_path / "latin.toml").write_bytes(b"seed = 1\n# caf\xe9\n")
    (tmp_path / "deep.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    (tmp_path / "fake.parquet").write_text("not parquet\n")
    return {"dir": tmp_path, "bad": tmp_path / "bad.rl", "notrl": tmp_path / "notrl.yaml",
            "raises": tmp_path / "raises.py", "exits": tmp_path / "exits.py",
            "exits_on_import": tmp_path / "exits_on_import.py", "norun": tmp_path / "norun", "afile": tmp_path / "afile",
            "latin": tmp_path / "latin.toml", "deep": tmp_path / "deep.toml", "latin_data": tmp_path / "latin.jsonl",
            "fake_parquet": tmp_path / "fake.parquet"}


# (command line with {placeholders} for the files above, exit code, a piece of the message)
CASES = [
    ("check grpo", EXIT_OK, "ok: grpo"),
    ("check {bad}", EXIT_BAD_INPUT, "error: unknown baseline 'group_mena'"),
    ("check no_such_spec", EXIT_BAD_INPUT, "no such spec file or library algorithm"),
    ("explain {bad}", EXIT_BAD_INPUT, "error: unknown baseline 'group_mena'"),
    ("explain grpo --format yaml", EXIT_BAD_INPUT, "error: --format must be 'text' or 'json'"),
    ("list baselin", EXIT_BAD_INPUT, "error: unknown slot 'baselin'; did you mean one of 'baseline'"),
    ("translate {notrl}", EXIT_BAD_INPUT, "error: neither a TRL GRPOConfig"),
    ("translate {dir}/missing.yaml", EXIT_BAD_INPUT, "error: config file not found"),
    ("translate " + str(HERE / "translate" / "trl_vespo_vllm.yaml"), EXIT_BAD_INPUT, "cannot be translated"),
    ("run no_such_spec", EXIT_BAD_INPUT, "no such spec file or library algorithm"),
    ("run {bad}", EXIT_BAD_INPUT, "error: unknown baseline 'group_mena'"),
    ("run grpo --set train.lrr=1", EXIT_BAD_INPUT, "train.lrr"),
    ("run grpo --config {dir}/missing.toml", EXIT_BAD_INPUT, "error: config file not found"),
    ("run grpo --model {dir}/no_model --out {dir}/r1", EXIT_BAD_INPUT, "error: model folder not found"),
    ("run grpo --resume {norun}", EXIT_BAD_INPUT, "not a run folder"),
    ("plot {dir}/no_run", EXIT_BAD_INPUT, "error: "),
    ("samples {norun}", EXIT_BAD_INPUT, "error: "),
    ("export {norun} --out {dir}/exported", EXIT_BAD_INPUT, "error: "),
    ("reward maht --completion 1 --answer 1", EXIT_BAD_INPUT, "error: unknown reward 'maht'"),
    ("reward no_such_reward_module:f --completion 1 --answer 1", EXIT_BAD_INPUT, "cannot import module"),
    ("reward {raises}:boom --completion 1 --answer 1", EXIT_FAILED, "ZeroDivisionError: no"),
    # a reward's sys.exit() is its error (exit 1, said), not the command's silent end with its code
    ("reward {exits}:bye --completion 1 --answer 1", EXIT_FAILED, "RuntimeError: the function called sys.exit(0)"),
    ("reward {exits}:three --completion 1 --answer 1", EXIT_FAILED, "the function called sys.exit(3)"),
    ("reward {exits_on_import}:f --completion 1 --answer 1", EXIT_BAD_INPUT, "failed: SystemExit: 0"),
    ("reward math --completion 1 --answer 1 --finish-reason eos", EXIT_BAD_INPUT, "--finish-reason"),
    ("ablate --vary kl:none", EXIT_BAD_INPUT, "missing BASE"),
    # settings and files that failed late (exit 1) or passed silently (issue 57, items 1, 6, 13)
    ("run grpo --set train.lr=inf", EXIT_BAD_INPUT, "train.lr: must be a finite number, got inf"),
    ("run grpo --set rollout.n=9223372036854775807", EXIT_BAD_INPUT, "rollout.n: must be between"),
    ("run grpo --seed 18446744073709551616", EXIT_BAD_INPUT, "seed: Input should be less than 4294967296"),
    ("run grpo --config {latin}", EXIT_BAD_INPUT, "latin.toml:2:6: not UTF-8 text (byte 0xe9)"),
    ("run grpo --config {deep}", EXIT_BAD_INPUT, "deep.toml: lists or tables nested too deeply"),
    ("run grpo --data {latin_data} --out {dir}/r2", EXIT_BAD_INPUT, "latin.jsonl:2:16: not UTF-8 text (byte 0xe9)"),
    ("run grpo --data {fake_parquet} --out {dir}/r3", EXIT_BAD_INPUT, "fake.parquet: not a readable Parquet file"),
    ("run grpo --out {afile}", EXIT_BAD_INPUT, "afile is a file, not a folder"),
    ("run grpo --out {afile}/run", EXIT_BAD_INPUT, "afile is a file, not a folder"),
    ("export {norun} --out {afile}", EXIT_BAD_INPUT, "afile is a file, not a folder"),
    ("ablate grpo --vary kl:none --out {afile}", EXIT_BAD_INPUT, "afile is a file, not a folder"),
    ("translate " + str(HERE / "translate" / "trl_grpo.yaml") + " --out {dir}", EXIT_BAD_INPUT,
     "exists and is not empty"),
    ("ablate {bad} --vary kl:none --out {dir}/study", EXIT_BAD_INPUT, "unknown baseline 'group_mena'"),
]


@pytest.mark.parametrize(("line", "code", "message"), CASES, ids=[c[0].split(" {")[0] for c in CASES])
def test_exit_code_table(files, line: str, code: int, message: str) -> None:
    args = [a.format(**files) for a in line.split()]
    res = runner.invoke(app, args)
    assert res.exit_code == code, res.output
    assert message in res.output
    assert "Traceback" not in res.output
    assert not any((files["dir"] / r).exists() for r in ("r2", "r3")), "a refused run left its folder"


@pytest.fixture
def fake_train(monkeypatch):
    """rldsl.runtime.run.loop.train replaced: raises what the test sets, after writing what it sets."""
    box = types.SimpleNamespace(error=None, before=None)
    fake = types.ModuleType("rldsl.runtime.run.loop")

    def train(spec, cfg, resume=None, restart=False):
        if box.before is not None:
            box.before(cfg)
        raise box.error

    fake.train = train
    monkeypatch.setitem(sys.modules, "rldsl.runtime.run.loop", fake)
    return box


def test_a_failed_run_is_1_with_a_traceback_hint(fake_train, tmp_path) -> None:
    fake_train.error = RuntimeError("out of prompts")
    res = runner.invoke(app, ["run", "grpo", "--out", str(tmp_path / "r")])
    assert res.exit_code == EXIT_FAILED
    assert "error: RuntimeError: out of prompts\n(run again with --traceback to see where)" in res.output


def test_interrupted_is_130_and_names_resume_only_with_a_checkpoint(fake_train, tmp_path) -> None:
    fake_train.error = KeyboardInterrupt()
    run = tmp_path / "r"
    res = runner.invoke(app, ["run", "grpo", "--out", str(run)])
    assert res.exit_code == EXIT_INTERRUPTED
    assert f"interrupted before the first checkpoint of {run}; `rldsl run --resume {run}` starts it " \
           "again from step 0" in res.output

    def checkpoint(cfg) -> None:  # a complete checkpoint, as checkpoint.save_checkpoint leaves it
        from rldsl.runtime.records.checkpoint import latest_checkpoint
        step = Path(cfg.out) / "checkpoints" / "step-2"
        step.mkdir(parents=True, exist_ok=True)
        (step / "COMPLETE").write_text(json.dumps({"step": 2, "format": 1}))
        (Path(cfg.out) / "checkpoints" / "latest").write_text("step-2")
        assert latest_checkpoint(cfg.out) is not None, "the fake checkpoint must count as complete"

    fake_train.before = checkpoint
    res = runner.invoke(app, ["run", "grpo", "--out", str(run)])
    assert res.exit_code == EXIT_INTERRUPTED
    assert res.output.endswith(f"interrupted; continue from checkpoint step-2 with:\nrldsl run --resume {run}\n")
