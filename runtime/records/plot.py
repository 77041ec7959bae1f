"""Training curves of one or more runs in one PNG (``rldsl plot``).

Panels: reward mean, held-out accuracy (greedy solid, sampled dashed), response length,
entropy, clip fraction (the metric names of metrics.py), then per-task accuracy and curriculum
levels when a run logged them (generated data), and a mixture-of-experts policy's routing
mismatch, router drift and expert load when a run logged ``moe/*``. Runs are overlaid, labelled by
their folder names. A panel whose metric no run logged is left out.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

from .metrics import (CLIP_FRACTION, ENTROPY, GREEDY_ACC, METRICS, MFU, MOE_EXPERT_LOAD_CV, MOE_EXPERT_LOAD_MAX,
                      MOE_ROUTER_DRIFT, MOE_ROUTING_MISMATCH, PADDING_RATIO, RESPONSE_LENGTH, REWARD, SAMPLED_ACC,
                      UPDATE_TOKENS_PER_S, metric_by_concept, read_metrics)
from .run_dir import CURVES_FILE, METRICS_FILE

__all__ = ["PANELS", "PERF_PANELS", "MOE_PANELS", "collect_panels", "plot_runs"]

#: (title, y label, (metric, line style) drawn in the panel): one panel per metric, titled
#: and labelled by metrics.METRICS, but the two held-out accuracies share one.
PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    (METRICS[REWARD].title, METRICS[REWARD].unit, ((REWARD, "-"),)),
    ("held-out accuracy", "accuracy (solid greedy, dashed sampled)", ((GREEDY_ACC, "-"), (SAMPLED_ACC, "--"))),
    *((METRICS[k].title, METRICS[k].unit, ((k, "-"),)) for k in (RESPONSE_LENGTH, ENTROPY, CLIP_FRACTION)),
)
#: the throughput panels ``rldsl plot --perf`` adds
PERF_PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = tuple(
    (METRICS[k].title, METRICS[k].unit, ((k, "-"),)) for k in (UPDATE_TOKENS_PER_S, PADDING_RATIO, MFU))


def _run_path(run: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(run folder, metrics file) for a run folder or a metrics .jsonl file."""
    path = Path(run)
    if path.is_file():
        return path.parent, path
    return path, path / METRICS_FILE


def _labels(folders: Sequence[Path]) -> list[str]:
    """Folder names; parent/name where two runs share a name."""
    names = [f.resolve().name for f in folders]
    return [f"{f.resolve().parent.name}/{n}" if names.count(n) > 1 else n
            for f, n in zip(folders, names)]


def _series(records: Sequence[dict[str, Any]], key: str, smooth: float,
            gaps: bool = False) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``, an EMA with ``smooth``. ``gaps``: a step without a value is a
    NaN point between the first and the last value (the line breaks there: a mix's task without
    rows at that step); else it is skipped."""
    xs: list[int] = []
    ys: list[float] = []
    ema: float | None = None
    for record in records:
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            if gaps and xs:
                xs.append(record["step"])
                ys.append(math.nan)
            continue
        ema = float(value) if ema is None or smooth <= 0 else smooth * ema + (1 - smooth) * value
        xs.append(record["step"])
        ys.append(ema)
    while ys and math.isnan(ys[-1]):
        xs.pop()
        ys.pop()
    return xs, ys


def _isolated(ys: Sequence[float]) -> bool:
    """Whether a value has no value beside it (a line would not show it: it needs a marker)."""
    def at(i: int) -> bool:
        return 0 <= i < len(ys) and not math.isnan(ys[i])
    return any(at(i) and not at(i - 1) and not at(i + 1) for i in range(len(ys)))


Line = tuple[str, str, str, list[int], list[float]]  # label, concept (metrics.Metric), style, steps, values

#: a mixture-of-experts policy's panels (docs/moe.md), drawn when a run logged them:
#: (title, y label, (metric, line style, the line's name beside the run's) drawn in the panel)
MOE_PANELS: tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...] = (
    ("MoE routing mismatch", "fraction of (token, layer) pairs", ((MOE_ROUTING_MISMATCH, "-", ""),)),
    ("MoE router drift", "fraction of (token, layer) pairs", ((MOE_ROUTER_DRIFT, "-", ""),)),
    ("MoE expert load", "busiest expert x E (solid), cv (dashed)",
     ((MOE_EXPERT_LOAD_MAX, "-", "max"), (MOE_EXPERT_LOAD_CV, "--", "cv"))),
)


def collect_panels(labels: Sequence[str], histories: Sequence[Sequence[dict[str, Any]]],
                   *, smooth: float = 0.0, perf: bool = False) -> list[tuple[str, str, list[Line]]]:
    """The panels that have data: ``(title, y label, lines)``, in :data:`PANELS` order (then
    :data:`PERF_PANELS` with ``perf``).

    Null values are gaps, not zeros.
    """
    panels = []
    for title, ylabel, concepts in PANELS + (PERF_PANELS if perf else ()):
        lines: list[Line] = []
        for key, style in concepts:
            concept, sparse = METRICS[key].concept, METRICS[key].sparse
            for label, records in zip(labels, histories):
                if not any(key in record for record in records):
                    continue
                # Evaluations are sparse: drawn raw, with markers, never smoothed.
                xs, ys = _series(records, key, 0.0 if sparse else smooth)
                if xs:
                    lines.append((label, concept, style, xs, ys))
        if lines:
            panels.append((title, ylabel, lines))
    panels += _family_panels(labels, histories, smooth)
    panels += _moe_panels(labels, histories, smooth)
    return panels


def _moe_panels(labels: Sequence[str], histories: Sequence[Sequence[dict[str, Any]]],
                smooth: float) -> list[tuple[str, str, list[Line]]]:
    """:data:`MOE_PANELS` that some run logged: a line per (run, metric)."""
    panels = []
    concept = METRICS[REWARD].concept  # a per-step (not sparse) series
    for title, ylabel, keys in MOE_PANELS:
        lines: list[Line] = []
        for label, records in zip(labels, histories):
            for key, style, name in keys:
                xs, ys = _series(records, key, smooth)
                if xs:
                    lines.append((f"{label}: {name}" if name else label, concept, style, xs, ys))
        if lines:
            panels.append((title, ylabel, lines))
    return panels


#: Metrics logged per task by generated data (data/reasoning_gym.py): a panel each, a line per
#: (run, task) -- "task/<task>/acc" and "curriculum/<task>/<attribute>". A step where a task had no
#: rows (a mix draws its tasks at random) breaks the task's line.
FAMILIES = (("per-task accuracy (rollouts, full credit)", "accuracy", "task/", "/acc"),
            ("curriculum levels", "level", "curriculum/", ""))


def _family_panels(labels: Sequence[str], histories: Sequence[Sequence[dict[str, Any]]],
                   smooth: float) -> list[tuple[str, str, list[Line]]]:
    panels = []
    concept = METRICS[REWARD].concept  # a per-step (not sparse) series
    for title, ylabel, prefix, suffix in FAMILIES:
        lines: list[Line] = []
        for label, records in zip(labels, histories):
            keys = sorted({k for r in records for k in r if k.startswith(prefix) and k.endswith(suffix)})
            for key in keys:
                xs, ys = _series(records, key, 0.0 if prefix == "curriculum/" else smooth, gaps=True)
                name = key[len(prefix):len(key) - len(suffix)]
                if xs:
                    lines.append((f"{label}: {name}" if len(labels) > 1 else name, concept, "-", xs, ys))
        if lines:
            panels.append((title, ylabel, lines))
    return panels


def plot_runs(run_dirs: Sequence[str | os.PathLike[str]], out_png: str | os.PathLike[str] | None = None,
              *, smooth: float = 0.0, perf: bool = False) -> Path:
    """Draw the curves of ``run_dirs`` into one PNG and return its path.

    ``run_dirs``: run folders (or their ``metrics.jsonl`` files). ``out_png``: where to
    write; None = ``<run>/curves.png`` for one run, ``./curves.png`` for several.
    ``smooth``: exponential moving average weight in [0, 1) applied to the per-step
    curves (0 = raw values); held-out accuracies are drawn raw, with markers. ``perf``: also
    the update's throughput, the padding ratio and the MFU. Raises FileNotFoundError for a run without metrics and ValueError
    when no run has any metric to draw.
    """
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run folder")
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth must be in [0, 1), got {smooth}")
    folders, histories = [], []
    for run in run_dirs:
        folder, metrics = _run_path(run)
        if not metrics.is_file():
            raise FileNotFoundError(f"no {METRICS_FILE} in {folder}: not a run folder")
        folders.append(folder)
        histories.append(read_metrics(metrics))
    labels = _labels(folders)
    panels = collect_panels(labels, histories, smooth=smooth, perf=perf)
    if not panels:
        raise ValueError("none of the runs logged a metric to plot (reward, accuracy, "
                         "response length, entropy, clip fraction)")

    # The Agg canvas on a bare Figure: no pyplot, so no global backend switch and no
    # window, whatever backend the caller's session uses.
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(6.0 * cols, 3.4 * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    series = labels + [line[0] for _, _, ls in panels for line in ls if line[0] not in labels]
    color_of = {label: colors[i % len(colors)] for i, label in enumerate(dict.fromkeys(series))}
    for ax, (title, ylabel, lines) in zip(axes.flat, panels):
        for label, concept, style, xs, ys in lines:
            name = label if concept != METRICS[SAMPLED_ACC].concept else f"{label} (sampled)"
            ax.plot(xs, ys, style, color=color_of[label], label=name, linewidth=1.4,
                    marker="o" if metric_by_concept(concept).sparse or _isolated(ys) else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()

    if out_png is None:
        out_png = folders[0] / CURVES_FILE if len(folders) == 1 else Path(CURVES_FILE)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, format="png")
    return out
