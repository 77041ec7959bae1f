"""The study report: ``report.md``, ``results.csv`` and ``figures/*.png``, from the run folders.

Per run (a variant with one seed), from its ``metrics.jsonl`` up to the study's step count:

* held-out accuracy (greedy, and sampled when evaluated): the value at the last evaluation
  (*final*) and the largest value of any evaluation, step 0 included (*best*);
* training reward (the rollouts' mean reward): *final* = the mean over the last W steps,
  *best* = the largest W-step moving average, W = 10% of the steps (1 to 25);
* steps to threshold: the first evaluation step whose greedy accuracy is >= the threshold
  (none when no evaluation reached it);
* response length, entropy and clip fraction at the end: means over the last W steps.

Per variant, each number is the mean ± sample standard deviation over the seeds that
finished (the seed count is in the table). Curves: the mean over seeds with a band of
± one standard deviation, at the steps every seed logged.
"""
from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..records.metrics import (CLIP_FRACTION, ENTROPY, GREEDY_ACC, METRICS, RESPONSE_LENGTH, REWARD, SAMPLED_ACC,
                               metric_by_concept, read_metrics)
from ..records.run_dir import METRICS_FILE
from .launch import RUNS_DIR, CellStatus, cell_state, read_status

__all__ = ["STUDY_FILE", "REPORT_FILE", "RESULTS_FILE", "FIGURES_DIR", "FIGURES",
           "RunNumbers", "run_numbers", "write_report", "load_study_file"]

STUDY_FILE = "study.json"
REPORT_FILE = "report.md"
RESULTS_FILE = "results.csv"
FIGURES_DIR = "figures"

#: concept -> (figure file stem, title, y label): the figures, in this order; the titles and
#: labels are metrics.METRICS's (the held-out accuracies' file stems keep their "heldout_").
FIGURES: dict[str, tuple[str, str, str]] = {
    m.concept: (("heldout_" if m.sparse else "") + m.concept, m.title, m.unit)
    for m in (METRICS[k] for k in (GREEDY_ACC, SAMPLED_ACC, REWARD, RESPONSE_LENGTH, ENTROPY, CLIP_FRACTION))
}
_PER_STEP = tuple(c for c in FIGURES if not metric_by_concept(c).sparse)


def window(steps: int) -> int:
    """W: the number of final steps averaged for the "at the end" numbers."""
    return max(1, min(25, round(steps / 10)))


@dataclass
class RunNumbers:
    """The report's numbers for one run (None where the run did not log the metric)."""

    steps: int = 0
    start_acc: float | None = None
    final_acc: float | None = None
    best_acc: float | None = None
    final_sampled_acc: float | None = None
    best_sampled_acc: float | None = None
    final_reward: float | None = None
    best_reward: float | None = None
    steps_to_threshold: int | None = None
    final_response_length: float | None = None
    final_entropy: float | None = None
    final_clip_fraction: float | None = None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _series(records: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of metric ``key`` where it is a finite number."""
    return [(r["step"], float(r[key])) for r in records if _number(r.get(key))]


def _moving(values: Sequence[float], w: int) -> list[float]:
    """Trailing means over ``w`` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= w:
            total -= values[i - w]
        out.append(total / min(i + 1, w))
    return out


def run_numbers(records: Sequence[Mapping[str, Any]], steps: int, threshold: float) -> RunNumbers:
    """The numbers of one run from its metrics records (only steps <= ``steps`` count)."""
    records = [r for r in records if r["step"] <= steps]
    w = window(steps)
    n = RunNumbers(steps=max((r["step"] for r in records), default=0))
    acc = _series(records, GREEDY_ACC)
    if acc:
        n.start_acc = acc[0][1] if acc[0][0] == 0 else None
        n.final_acc, n.best_acc = acc[-1][1], max(v for _, v in acc)
        n.steps_to_threshold = next((s for s, v in acc if v >= threshold), None)
    sampled = _series(records, SAMPLED_ACC)
    if sampled:
        n.final_sampled_acc, n.best_sampled_acc = sampled[-1][1], max(v for _, v in sampled)
    reward = [v for _, v in _series(records, REWARD)]
    if reward:
        n.final_reward = statistics.fmean(reward[-w:])
        n.best_reward = max(_moving(reward, w)[min(w, len(reward)) - 1:])
    for key, attr in ((RESPONSE_LENGTH, "final_response_length"),
                      (ENTROPY, "final_entropy"), (CLIP_FRACTION, "final_clip_fraction")):
        values = [v for _, v in _series(records, key)]
        if values:
            setattr(n, attr, statistics.fmean(values[-w:]))
    return n


# ----------------------------------------------------------------------------- study file

def load_study_file(folder: Path) -> dict[str, Any]:
    """``study.json`` of a study folder; FileNotFoundError when the folder is no study."""
    path = folder / STUDY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a study folder (no {STUDY_FILE}): run "
                                f"`rldsl ablate BASE --vary ... --out {folder}` first")
    return json.loads(path.read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------- formatting

def _mean_std(values: Sequence[float]) -> tuple[float, float | None] | None:
    if not values:
        return None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _fmt(values: Sequence[float], digits: int) -> str:
    ms = _mean_std(values)
    if ms is None:
        return "–"
    mean, std = ms
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def _fmt_steps(values: Sequence[int | None]) -> str:
    reached = [v for v in values if v is not None]
    if not values:
        return "–"
    share = f"({len(reached)}/{len(values)})"
    if not reached:
        return f"never {share}"
    return f"{_fmt(reached, 0)} {share}"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ----------------------------------------------------------------------------- figures

def _band(per_seed: Sequence[Sequence[tuple[int, float]]]) -> tuple[list[int], list[float], list[float]]:
    """Mean and std over seeds at the steps that every seed logged."""
    common = set.intersection(*(set(s for s, _ in series) for series in per_seed))
    xs = sorted(common)
    rows = [dict(series) for series in per_seed]
    means, stds = [], []
    for x in xs:
        vals = [r[x] for r in rows]
        means.append(statistics.fmean(vals))
        stds.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
    return xs, means, stds


def _figures(folder: Path, variants: Sequence[Mapping[str, Any]],
             histories: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], steps: int) -> list[tuple[str, Path]]:
    """One PNG per metric with a line and a band per variant; returns (concept, path)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    import matplotlib

    w = window(steps)
    colors = [c for c in matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]]
    out: list[tuple[str, Path]] = []
    (folder / FIGURES_DIR).mkdir(exist_ok=True)
    for concept, (stem, title, ylabel) in FIGURES.items():
        lines = []
        for v in variants:
            per_seed = []
            for records in histories.get(v["name"], []):
                series = _series([r for r in records if r["step"] <= steps], metric_by_concept(concept).key)
                if concept in _PER_STEP and series:
                    xs = [s for s, _ in series]
                    series = list(zip(xs, _moving([y for _, y in series], w)))
                if series:
                    per_seed.append(series)
            if per_seed:
                lines.append((v, len(per_seed), *_band(per_seed)))
        if not lines:
            continue
        fig = Figure(figsize=(9.0, 4.2))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        k = 0
        for v, n_seeds, xs, means, stds in lines:
            if v.get("is_base"):
                color = "black"
            else:
                color, k = colors[k % len(colors)], k + 1
            sparse = metric_by_concept(concept).sparse
            ax.plot(xs, means, color=color, linewidth=1.8 if v.get("is_base") else 1.4,
                    marker="o" if sparse or len(xs) == 1 else None, markersize=3,
                    label=f"{v['label']} (n={n_seeds})")
            if n_seeds > 1:
                lo = [m - s for m, s in zip(means, stds)]
                hi = [m + s for m, s in zip(means, stds)]
                ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
        smoothing = f", {w}-step moving average" if concept in _PER_STEP and w > 1 else ""
        ax.set_title(f"{title}{smoothing}; mean ± std over seeds")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        path = folder / FIGURES_DIR / f"{stem}.png"
        fig.savefig(path, dpi=110, format="png")
        out.append((concept, path))
    return out


# ----------------------------------------------------------------------------- the report

_COLUMNS = ["variant", "label", "seed", "status", "steps", "change", "start_acc", "final_acc",
            "best_acc", "final_sampled_acc", "best_sampled_acc", "final_reward", "best_reward",
            "steps_to_threshold", "final_response_length", "final_entropy",
            "final_clip_fraction", "seconds", "run_dir"]


def write_report(folder: str | Path, threshold: float | None = None) -> Path:
    """(Re)build ``report.md``, ``results.csv`` and ``figures/`` of a study folder from its
    run folders; return the path of ``report.md``. Runs that did not finish are listed
    with their status and error, never averaged in. ``threshold``: the accuracy of the
    "steps to" column (default: the study's)."""
    folder = Path(folder)
    study = load_study_file(folder)
    statuses = read_status(folder)
    steps = int(study["steps"])
    threshold = float(study["threshold"] if threshold is None else threshold)
    variants = study["variants"]
    numbers: dict[str, list[tuple[int, RunNumbers]]] = {}
    histories: dict[str, list[list[dict[str, Any]]]] = {}
    rows: list[dict[str, Any]] = []
    problems: list[tuple[str, int, CellStatus]] = []
    for v in variants:
        numbers[v["name"]], histories[v["name"]] = [], []
        for seed in study["seeds"]:
            cell = f"{v['name']}-s{seed}"
            run_dir = folder / RUNS_DIR / cell
            st = statuses.get(cell) or CellStatus(variant=v["name"], seed=seed)
            status = st.status
            row: dict[str, Any] = {"variant": v["name"], "label": v["label"], "seed": seed,
                                   "status": status, "change": "; ".join(v["changes"]),
                                   "seconds": st.seconds, "run_dir": str(run_dir.relative_to(folder))}
            if status != "done" and cell_state(run_dir, steps)[0] == "done":
                status = row["status"] = "done"  # finished, though status.json missed it
            if status == "done" and (run_dir / METRICS_FILE).is_file():
                records = read_metrics(run_dir)
                n = run_numbers(records, steps, threshold)
                numbers[v["name"]].append((seed, n))
                histories[v["name"]].append(records)
                row.update({k: getattr(n, k) for k in RunNumbers.__dataclass_fields__})
            else:
                problems.append((v["label"], seed, st))
            rows.append(row)

    with open(folder / RESULTS_FILE, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in _COLUMNS})

    figures = _figures(folder, variants, histories, steps)
    w = window(steps)
    base = next((v for v in variants if v.get("is_base")), None)
    base_final = [n.final_acc for _, n in numbers.get(base["name"], []) if n.final_acc is not None] if base else []
    done = sum(len(x) for x in numbers.values())
    total = len(variants) * len(study["seeds"])

    L: list[str] = []
    L.append(f"# Ablation study `{study['name']}`")
    L.append("")
    mode = "one alternative at a time against the base" if study["definition"]["one_at_a_time"] else "full grid of the axes"
    sets = ", ".join(f"`{s}`" for s in study["definition"]["set"]) or "none"
    L.append(f"- base: `{study['base']}` ({study['base_file']})")
    L.append(f"- variants: {len(variants)}, {mode}; seeds: {', '.join(map(str, study['seeds']))}; "
             f"steps: {steps}")
    L.append(f"- run settings (`--set`): {sets}")
    L.append(f"- runs finished: {done} of {total}" + (f"; not finished: {total - done} (see below)"
                                                      if done < total else ""))
    sessions = study.get("sessions", [])
    if sessions:
        cell_s = sum(r["seconds"] or 0 for r in rows if r["status"] == "done")
        L.append(f"- wall time: {sum(x['seconds'] for x in sessions) / 60:.1f} min in "
                 f"{len(sessions)} invocation(s) (cells at a time: "
                 f"{', '.join(str(x['jobs']) for x in sessions)}); the finished cells' last "
                 f"attempts took {cell_s / 60:.1f} min together")
    L.append(f"- written {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; rebuild with "
             f"`rldsl ablate --report {folder}`")
    L.append("")
    L.append(f"Mean ± std over the seeds that finished (n). Accuracy: held-out, greedy; *final* "
             f"at the last evaluation, *best* over all evaluations (step 0 included). Reward: "
             f"training rollouts; *final* = mean of the last {w} steps, *best* = best {w}-step "
             f"moving average. *Steps to {threshold:g}*: first evaluation with greedy accuracy "
             f">= {threshold:g} (seeds that reached it / seeds). Length, entropy and clip "
             f"fraction: means of the last {w} steps.")
    L.append("")
    head = ["variant", "change vs base", "n", "final acc", "best acc"]
    if base_final:
        head.append("Δ final acc")
    head += ["final reward", "best reward", f"steps to {threshold:g}", "length", "entropy", "clip frac"]
    L.append("| " + " | ".join(head) + " |")
    L.append("|" + "|".join(["---"] * 2 + ["--:"] * (len(head) - 2)) + "|")
    for v in variants:
        ns = [n for _, n in numbers[v["name"]]]
        change = "(the base)" if v.get("is_base") else ("; ".join(v["changes"]) or "= base")
        if v.get("error"):
            change = "invalid spec"

        def col(attr: str, digits: int) -> str:
            return _fmt([getattr(n, attr) for n in ns if getattr(n, attr) is not None], digits)

        cells = [f"`{v['label']}`", _md(change.replace(" -> ", " → ")), str(len(ns)), col("final_acc", 3), col("best_acc", 3)]
        if base_final:
            finals = [n.final_acc for n in ns if n.final_acc is not None]
            cells.append("–" if not finals or v.get("is_base") else
                         f"{statistics.fmean(finals) - statistics.fmean(base_final):+.3f}")
        cells += [col("final_reward", 3), col("best_reward", 3),
                  _fmt_steps([n.steps_to_threshold for n in ns]) if ns else "–",
                  col("final_response_length", 2), col("final_entropy", 3),
                  col("final_clip_fraction", 4)]
        L.append("| " + " | ".join(cells) + " |")
    L.append("")

    if figures:
        L.append("## Curves")
        L.append("")
        for concept, path in figures:
            L.append(f"![{FIGURES[concept][1]}]({path.relative_to(folder).as_posix()})")
            L.append("")

    L.append("## Variants against the base (`rldsl explain BASE VARIANT`)")
    L.append("")
    for v in variants:
        spec = f"cells/{v['name']}.rl"
        if v.get("is_base"):
            L.append(f"- `{v['label']}`: `{spec}`, the base itself")
            continue
        L.append(f"- `{v['label']}`: `{spec}`" + (" — invalid, see below" if v.get("error") else ""))
        for row in v.get("diff_rows", []):
            L.append(f"  - {row['slot']}: `{row['a']}` → `{row['b']}` ({row['status']})")
    L.append("")

    if problems:
        L.append("## Runs that did not finish")
        L.append("")
        for label, seed, st in problems:
            what = st.status + (f", exit code {st.returncode}" if st.returncode not in (None, 0) else "")
            where = (f"spec `cells/{st.variant}.rl`" if st.status == "invalid"
                     else f"log `logs/{st.variant}-s{seed}.log`")
            L.append(f"- `{label}` seed {seed}: {what}; {where}")
            if st.error:
                L.append("")
                L.append("  ```text")
                L.extend("  " + line for line in st.error.splitlines())
                L.append("  ```")
        L.append("")

    L.append(f"Per-run numbers: [{RESULTS_FILE}]({RESULTS_FILE}).")
    path = folder / REPORT_FILE
    path.write_text("\n".join(L) + "\n", encoding="utf-8")
    return path

