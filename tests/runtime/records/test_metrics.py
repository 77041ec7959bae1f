"""metrics.jsonl writing, resume truncation, progress output, TensorBoard, summary table."""
from __future__ import annotations

import contextlib
import io
import json
import sys

import numpy as np
import pytest
import torch
from rich.console import Console

from rldsl.runtime.records.metrics import (MetricsLogger, read_metrics, sanitize, summary_table,
                                   truncate_metrics)


def quiet() -> Console:
    return Console(file=io.StringIO(), force_terminal=False, width=120)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_flushed_line_per_step_with_safe_values(tmp_path):
    logger = MetricsLogger(tmp_path, console=quiet())
    logger.log(1, {"reward_mean": 0.5, "loss": float("nan"), "kl": float("inf"),
                   "clip_fraction": torch.tensor(0.25), "n": np.int64(3), "ok": True,
                   "lengths": torch.tensor([1.0, float("-inf")]), "note": "x"})
    # Readable while the logger is still open: every line is flushed.
    assert lines(tmp_path / "metrics.jsonl") == [
        {"step": 1, "reward_mean": 0.5, "loss": None, "kl": None, "clip_fraction": 0.25,
         "n": 3, "ok": True, "lengths": [1.0, None], "note": "x"}]
    logger.log(2, {"reward_mean": 0.75})
    logger.close()
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [1, 2]
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text


def test_sanitize_leaves_plain_values_alone():
    assert sanitize({"a": 1, "b": [2.5, None], "c": "s"}) == {"a": 1, "b": [2.5, None], "c": "s"}
    assert sanitize(np.float32(0.5)) == 0.5 and type(sanitize(np.float32(0.5))) is float


def test_step_conflict_and_closed_logger(tmp_path):
    logger = MetricsLogger(tmp_path, console=quiet())
    with pytest.raises(ValueError, match="step"):
        logger.log(3, {"step": 4})
    logger.log(3, {"step": 3, "x": 1.0})  # an agreeing step is fine
    logger.close()
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(4, {})


def _metrics(step: int) -> dict:
    return {"reward_mean": step / 10, "clip_fraction": 0.0}


def test_resumed_file_equals_an_uninterrupted_one(tmp_path):
    straight, crashed = tmp_path / "a", tmp_path / "b"
    with MetricsLogger(straight, console=quiet()) as logger:
        for step in range(1, 11):
            logger.log(step, _metrics(step))

    with MetricsLogger(crashed, console=quiet()) as logger:
        for step in range(1, 8):  # checkpoint at 5, crash after 7 ...
            logger.log(step, _metrics(step))
    with open(crashed / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "reward_me')  # ... in the middle of a line

    logger = MetricsLogger(crashed, resume_step=5, console=quiet())
    assert [r["step"] for r in logger.records] == [1, 2, 3, 4, 5]
    for step in range(6, 11):
        logger.log(step, _metrics(step))
    logger.close()
    assert (crashed / "metrics.jsonl").read_text() == (straight / "metrics.jsonl").read_text()


def test_truncate_metrics_counts_dropped_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\nnot json\n{"step": 3}\n')
    assert truncate_metrics(tmp_path, 1) == 3
    assert path.read_text() == '{"step": 1}\n'
    assert truncate_metrics(tmp_path, 1) == 0
    assert truncate_metrics(tmp_path / "absent", 1) == 0


def test_fresh_logger_refuses_existing_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(FileExistsError, match="already holds metrics"):
        MetricsLogger(tmp_path, console=quiet())


def test_read_metrics_skips_a_cut_line_with_a_warning(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 2}\n{"step": 2, "a"')
    with pytest.warns(UserWarning, match=r"line\(s\) \[2\]"):
        assert read_metrics(tmp_path) == [{"step": 1, "a": 2}]
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "nothing")


def test_plain_progress_lines_when_not_a_terminal(tmp_path):
    console = quiet()
    with MetricsLogger(tmp_path, total_steps=6, print_every=4, console=console) as logger:
        for step in range(1, 7):
            extra = {"eval/greedy_acc": 0.5} if step == 3 else {}
            logger.log(step, {"reward_mean": step / 8, "clip_fraction": 0.02, "step_s": 0.125,
                              **extra})
    out = console.file.getvalue().splitlines()
    # the first step, every 4th step, the evaluation step, and the last step
    assert [line.split(" |")[0] for line in out] == ["step 1/6", "step 3/6", "step 4/6", "step 6/6"]
    assert out[1] == "step 3/6 | reward 0.375 | acc 0.5 | clip 0.02 | 0.12 s/step"
    assert "acc 0.5" in out[3]  # the last held-out accuracy stays on display


def test_every_step_with_every_1_and_a_resumed_run_shows_its_first_step(tmp_path):
    console = quiet()
    with MetricsLogger(tmp_path / "a", total_steps=3, print_every=1, console=console) as logger:
        for step in range(1, 4):
            logger.log(step, {"reward_mean": 0.5})
    assert [ln.split(" |")[0] for ln in console.file.getvalue().splitlines()] == ["step 1/3", "step 2/3", "step 3/3"]
    console = quiet()
    with MetricsLogger(tmp_path / "a", total_steps=30, print_every=10, console=console, resume_step=3) as logger:
        for step in range(4, 12):
            logger.log(step, {"reward_mean": 0.5})
    assert [ln.split(" |")[0] for ln in console.file.getvalue().splitlines()] == ["step 4/30", "step 10/30"]


def test_log_every_and_its_old_name(tmp_path):
    from rldsl.runtime.config import load_config
    assert load_config(None, ["log.every=3"]).log.every == 3
    assert load_config(None, ["log.print_every=4"]).log.every == 4  # the old name still works
    (tmp_path / "c.toml").write_text("[log]\nprint_every = 5\n")
    assert load_config(tmp_path / "c.toml").log.every == 5


def test_messages_are_not_wrapped_when_piped(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=1, progress=False)
    assert not logger.console.is_terminal
    long_path = "/a/" + "b" * 150 + "/run"
    with contextlib.redirect_stdout(io.StringIO()) as buf:
        logger.console.file = buf
        logger.print(f"interrupted; continue with:\nrldsl run --resume {long_path}")
    logger.close()
    assert f"rldsl run --resume {long_path}\n" in buf.getvalue()  # one line, pasteable


def test_progress_bar_on_a_terminal(tmp_path):
    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    with MetricsLogger(tmp_path, total_steps=3, console=console) as logger:
        for step in range(1, 4):
            logger.log(step, {"reward_mean": 0.25, "eval/sampled_acc": 0.5})
    out = console.file.getvalue()
    assert "train" in out and "3/3" in out and "reward 0.25" in out and "acc~ 0.5" in out


def test_progress_off_prints_nothing(tmp_path):
    console = quiet()
    with MetricsLogger(tmp_path, progress=False, console=console) as logger:
        logger.log(10, {"reward_mean": 1.0})
    assert console.file.getvalue() == ""


def test_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, tensorboard=True, console=quiet()) as logger:
        logger.log(1, {"reward_mean": 0.5, "note": "text is skipped", "bad": float("nan")})
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


def test_tensorboard_missing_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'rldsl\[tensorboard\]'"):
        MetricsLogger(tmp_path, tensorboard=True, console=quiet())


def test_summary_table_final_and_best(tmp_path):
    records = [
        {"step": 1, "reward_mean": 0.2, "eval/greedy_acc": 0.30, "clip_fraction": 0.1},
        {"step": 2, "reward_mean": 0.9, "clip_fraction": 0.0},
        {"step": 3, "reward_mean": 0.7, "eval/greedy_acc": 0.55, "clip_fraction": None},
    ]
    console = Console(file=io.StringIO(), width=200)
    console.print(summary_table(records, tmp_path / "run-1"))
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in console.file.getvalue().splitlines() if line.startswith("│")}
    assert rows["steps"] == ["3", "", ""]
    assert rows["reward_mean"] == ["0.7", "0.9", "2"]       # final, best, best at step
    assert rows["eval/greedy_acc"] == ["0.55", "0.55", "3"]
    assert rows["clip_fraction"] == ["0", "", ""]           # last non-null value, no "best"
    assert f"run folder: {tmp_path / 'run-1'}" in console.file.getvalue()


def test_print_summary_from_the_logger(tmp_path):
    console = quiet()
    with MetricsLogger(tmp_path, progress=False, console=console) as logger:
        logger.log(1, {"reward_mean": 0.5})
        logger.print_summary()
    assert "run summary" in console.file.getvalue() and "reward_mean" in console.file.getvalue()


def test_the_step_timer_adds_each_phase_under_its_metric_name():
    """timed(m, phase) records time/<phase>_s (adding up when a phase runs twice); an unknown
    phase is refused, so a step cannot time a phase under a second spelling."""
    from rldsl.runtime.records.metrics import PHASES, TRAINER_WAIT, time_key, timed

    m: dict[str, float] = {}
    with timed(m, "update"):
        pass
    first = m["time/update_s"]
    with timed(m, "update"):
        pass
    assert set(m) == {"time/update_s"} and m["time/update_s"] >= first >= 0
    with pytest.raises(RuntimeError), timed(m, "sync"):
        raise RuntimeError("the phase failed")
    assert "time/sync_s" in m  # timed even when it raises
    assert time_key("trainer_wait") == TRAINER_WAIT and "rollout" in PHASES
    with pytest.raises(KeyError, match="no timed phase 'updates'"):
        time_key("updates")
