"""rldsl plot: one PNG with a panel per metric, runs overlaid."""
from __future__ import annotations

import json
import struct

import pytest

import rldsl.runtime.records.plot as plot_module
from rldsl.runtime.records.plot import collect_panels, plot_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(folder, records) -> None:
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def two_runs(tmp_path):
    a, b = tmp_path / "grpo-1", tmp_path / "dapo-1"
    write_run(a, [{"step": s, "reward_mean": s / 10, "response_length": 3.0 + s,
                   "clip_fraction": 0.0, "entropy": 1.0 / s,
                   **({"eval/greedy_acc": s / 20, "eval/sampled_acc": s / 30} if s % 2 == 0 else {})}
                  for s in range(1, 7)])
    # The second run has no entropy or sampled accuracy, and a gap in its response length.
    write_run(b, [{"step": s, "reward_mean": 1 - s / 10, "clip_fraction": 0.1,
                   "response_length": None if s == 3 else 4.0,
                   **({"eval/greedy_acc": 0.2} if s in (1, 6) else {})}
                  for s in range(1, 7)])
    return a, b


def test_png_of_two_runs(two_runs, tmp_path, monkeypatch):
    read = []
    real = plot_module.read_metrics
    monkeypatch.setattr(plot_module, "read_metrics", lambda p: read.append(p) or real(p))
    out = plot_runs(list(two_runs), tmp_path / "out" / "cmp.png")
    assert out == tmp_path / "out" / "cmp.png"
    assert [p.parent.name for p in read] == ["grpo-1", "dapo-1"]   # both runs were read
    width, height = png_size(out)
    # 5 panels -> 2 columns x 3 rows of 6.0 x 3.4 inches at 110 dpi
    assert (width, height) == (1320, 1122)


def test_panels_overlay_runs_and_skip_missing_metrics(two_runs):
    from rldsl.runtime.records.metrics import read_metrics

    panels = collect_panels(["grpo-1", "dapo-1"], [read_metrics(p) for p in two_runs])
    by_title = {title: lines for title, _ylabel, lines in panels}
    assert list(by_title) == ["training reward", "held-out accuracy", "response length", "policy entropy",
                              "clip fraction"]
    assert [(l[0], l[1]) for l in by_title["held-out accuracy"]] == [
        ("grpo-1", "greedy_acc"), ("dapo-1", "greedy_acc"), ("grpo-1", "sampled_acc")]
    assert [l[0] for l in by_title["policy entropy"]] == ["grpo-1"]
    reward_b = by_title["training reward"][1]
    assert reward_b[3] == [1, 2, 3, 4, 5, 6] and reward_b[4] == pytest.approx([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    length_b = by_title["response length"][1]
    assert length_b[3] == [1, 2, 4, 5, 6]  # a null is a gap, not a zero
    greedy_a = by_title["held-out accuracy"][0]
    assert greedy_a[3] == [2, 4, 6]


def test_smoothing_is_an_ema(two_runs):
    from rldsl.runtime.records.metrics import read_metrics

    panels = collect_panels(["a"], [read_metrics(two_runs[0])], smooth=0.5)
    reward = panels[0][2][0][4]
    assert reward[:3] == pytest.approx([0.1, 0.15, 0.225])
    greedy = panels[1][2][0][4]
    assert greedy == pytest.approx([0.1, 0.2, 0.3])  # evaluations are never smoothed


def test_single_run_default_path_and_fewer_panels(tmp_path):
    run = tmp_path / "only"
    write_run(run, [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.3}])
    out = plot_runs([run])
    assert out == run / "curves.png"
    assert png_size(out) == (660, 374)  # one panel


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        plot_runs([tmp_path / "missing"])
    write_run(tmp_path / "empty", [{"step": 1, "other": 1.0}])
    with pytest.raises(ValueError, match="none of the runs logged a metric"):
        plot_runs([tmp_path / "empty"])


def test_perf_panels_only_when_asked(tmp_path):
    from rldsl.runtime.records.metrics import read_metrics

    run = tmp_path / "packed"
    write_run(run, [{"step": s, "reward_mean": 0.5, "perf/update_tokens_per_s": 100.0 * s,
                     "perf/padding_ratio": 0.1, "perf/mfu": 0.2} for s in range(1, 4)])
    records = [read_metrics(run / "metrics.jsonl")]
    assert [t for t, _, _ in collect_panels(["r"], records)] == ["training reward"]
    titles = [t for t, _, _ in collect_panels(["r"], records, perf=True)]
    assert titles == ["training reward", "update throughput", "padding in the training forwards",
                      "model FLOPs utilisation"]
    out = plot_runs([run], tmp_path / "perf.png", perf=True)
    assert png_size(out) == (1320, 748)  # 4 panels: 2 x 2


def test_a_task_line_breaks_at_the_steps_where_the_task_had_no_rows(tmp_path):
    """A mix draws its tasks at random: task/<task>/acc is missing at a step where the task had no
    rows, and the task's line breaks there (a NaN point) instead of joining its neighbours."""
    import math

    from rldsl.runtime.records.metrics import read_metrics

    run = tmp_path / "mix"
    write_run(run, [{"step": s, "reward_mean": 0.5, "task/a/acc": 0.5, **({"task/b/acc": 1.0} if s != 3 else {})}
                    for s in range(1, 6)] + [{"step": 6, "reward_mean": 0.5, "task/a/acc": 0.5}])
    panels = {title: lines for title, _, lines in collect_panels(["mix"], [read_metrics(run / "metrics.jsonl")])}
    (a, b) = panels["per-task accuracy (rollouts, full credit)"]
    assert a[0] == "a" and a[3] == [1, 2, 3, 4, 5, 6] and a[4] == [0.5] * 6
    assert b[0] == "b" and b[3] == [1, 2, 3, 4, 5]  # no point after its last value
    assert b[4][:2] == [1.0, 1.0] and math.isnan(b[4][2]) and b[4][3:] == [1.0, 1.0]
    assert not plot_module._isolated(b[4]) and plot_module._isolated([math.nan, 1.0, math.nan, 1.0, 1.0])


def test_moe_panels_when_the_run_logged_routing(tmp_path):
    """A mixture-of-experts run's routing: routing mismatch, router drift and expert load (max
    solid, cv dashed) panels after the others; none for a run without moe/* metrics."""
    from rldsl.runtime.records.metrics import read_metrics

    run = tmp_path / "moe"
    write_run(run, [{"step": s, "reward_mean": 0.5, "moe/routing_mismatch": 0.1 / s, "moe/router_drift": 0.02 * s,
                     "moe/expert_load_max": 1.5, "moe/expert_load_cv": 0.3} for s in range(1, 4)])
    panels = collect_panels(["r"], [read_metrics(run / "metrics.jsonl")])
    assert [t for t, _, _ in panels] == ["training reward", "MoE routing mismatch", "MoE router drift",
                                         "MoE expert load"]
    mismatch = panels[1][2]
    assert [(label, xs, ys) for label, _, _, xs, ys in mismatch] == [("r", [1, 2, 3], [0.1, 0.05, 0.1 / 3])]
    assert [(label, style) for label, _, style, _, _ in panels[3][2]] == [("r: max", "-"), ("r: cv", "--")]
    out = plot_runs([run], tmp_path / "moe.png")
    assert png_size(out) == (1320, 748)  # 4 panels: 2 x 2
    dense = tmp_path / "dense"
    write_run(dense, [{"step": 1, "reward_mean": 0.5}])
    assert [t for t, _, _ in collect_panels(["d"], [read_metrics(dense / "metrics.jsonl")])] == ["training reward"]
