"""On-policy distillation against RL on the embedded task (docs/distillation.md, "A CPU demo").

    python demos/distill.py [--root runs/distill_demo] [--steps 150] [--seeds 1 2 3]

1. The teacher: `rldsl run lite_ppo --seed 0 --steps TEACHER_STEPS` from the embedded warm start
   (held-out greedy accuracy ~0.27 -> ~0.9); its final checkpoint's policy folder is the teacher.
2. The student: the same warm start (the weaker model of the same shape), trained for STEPS steps
   by `opd` (teacher.path = that policy) and by `lite_ppo` (the task reward), seeds 1 2 3 each,
   every run with the same batch (16 prompts x 8 samples) and held-out evaluation every EVERY
   steps.
3. One figure (held-out greedy accuracy against steps and against the training steps'
   cumulative wall time, mean and each seed) and one markdown table.

Runs already finished under ``--root`` are kept (re-running only redraws); each run is a child
process `rldsl run ...` (niced: the machine is shared). ``--plot-only`` draws from what is there.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rldsl.runtime.records.metrics import read_metrics

GREEDY = "eval/greedy_acc"


def rldsl(*args: str) -> list[str]:
    return ["nice", "-n", "10", sys.executable, "-c", "from rldsl.cli import app; app()", "run", *args]


def finished(run: Path) -> bool:
    return (run / "metrics.jsonl").is_file() and any((run / "checkpoints").glob("*/policy/config.json"))


def train(run: Path, spec: str, seed: int, steps: int, every: int, *extra: str) -> None:
    if finished(run):
        return
    cmd = rldsl(spec, "--seed", str(seed), "--steps", str(steps), "--out", str(run),
                "--set", f"eval.every={every}", "--set", "checkpoint.every=0", *extra)
    print("$", " ".join(cmd[3:] if cmd[0] == "nice" else cmd), flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    (run / "demo_wall_s.json").write_text(json.dumps({"wall_s": time.perf_counter() - t}))


def teacher_policy(run: Path) -> Path:
    """The policy folder of the run's newest checkpoint."""
    return sorted((run / "checkpoints").glob("*/policy"))[-1]


def curve(run: Path) -> tuple[list[int], list[float], list[float]]:
    """(steps, cumulative training seconds at each, greedy accuracy) of the evaluations."""
    recs = read_metrics(run)
    cum, t = {0: 0.0}, 0.0
    for r in recs:
        if "step_s" in r:
            t += r["step_s"]
            cum[r["step"]] = t
    ev = [r for r in recs if GREEDY in r]
    return [r["step"] for r in ev], [cum.get(r["step"], 0.0) for r in ev], [r[GREEDY] for r in ev]


def plot(runs: dict[str, list[Path]], teacher_acc: float, out: Path) -> None:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax_s, ax_t = fig.subplots(1, 2, sharey=True)
    for c, (name, folders) in zip(colors, runs.items()):
        curves = [curve(f) for f in folders if (f / "metrics.jsonl").is_file()]
        for k, (steps, secs, acc) in enumerate(curves):
            ax_s.plot(steps, acc, color=c, alpha=0.35, lw=1)
            ax_t.plot(secs, acc, color=c, alpha=0.35, lw=1)
        if curves:
            n = min(len(a) for _, _, a in curves)
            mean = [sum(a[i] for _, _, a in curves) / len(curves) for i in range(n)]
            secs = [sum(s[i] for _, s, _ in curves) / len(curves) for i in range(n)]
            ax_s.plot(curves[0][0][:n], mean, color=c, lw=2.2, label=f"{name} (mean of {len(curves)} seeds)")
            ax_t.plot(secs, mean, color=c, lw=2.2, label=name)
    for ax in (ax_s, ax_t):
        ax.axhline(teacher_acc, color="gray", ls="--", lw=1, label="teacher" if ax is ax_s else None)
        ax.grid(alpha=0.3)
    ax_s.set_xlabel("step (16 prompts x 8 samples)")
    ax_t.set_xlabel("training seconds (sum of step times; shared 2-core CPU)")
    ax_s.set_ylabel("held-out greedy accuracy (200 prompts)")
    ax_s.legend(loc="lower right", fontsize=8)
    fig.suptitle("Same student (warm start), same steps: on-policy distillation (opd) vs RL (lite_ppo)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(runs: dict[str, list[Path]]) -> str:
    lines = ["| spec | seed | greedy acc, step 0 -> last (steps) | acc at half the steps | mean acc over the evaluations after step 0 "
             "| training s (sum of steps) | median s / step | median logprobs s / step | of which the teacher's forward "
             "(median time/teacher_s) | whole command |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, folders in runs.items():
        for f in folders:
            if not (f / "metrics.jsonl").is_file():
                continue
            steps, secs, acc = curve(f)
            recs = [r for r in read_metrics(f) if "step_s" in r]
            med = statistics.median(r["step_s"] for r in recs)
            lp = statistics.median(r.get("time/logprobs_s", 0.0) for r in recs)
            teacher = [r["time/teacher_s"] for r in recs if "time/teacher_s" in r]  # runs with a teacher only
            tf = f"{statistics.median(teacher):.3f}" if teacher else "-"
            h = len(acc) // 2
            wall = json.loads((f / "demo_wall_s.json").read_text())["wall_s"] if (f / "demo_wall_s.json").is_file() else float("nan")
            seed = json.loads((f / "config.json").read_text()).get("seed")
            lines.append(f"| {name} | {seed} | {acc[0]:.3f} -> {acc[-1]:.3f} ({steps[-1]}) | {acc[h]:.3f} (step {steps[h]}) "
                         f"| {statistics.mean(acc[1:]):.3f} | {secs[-1]:.0f} | {med:.2f} | {lp:.3f} | {tf} | {wall:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("runs/distill_demo"))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--teacher-steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--out", type=Path, default=Path("docs/distillation_curves.png"))
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    root = args.root
    teacher = root / "teacher"
    specs = ("opd", "lite_ppo")
    runs = {s: [root / f"{s}-seed{seed}" for seed in args.seeds] for s in specs}
    if not args.plot_only:
        train(teacher, "lite_ppo", 0, args.teacher_steps, 50)
        for seed in args.seeds:  # one seed of each spec, then the next (a cut-short study stays balanced)
            for s in specs:
                extra = ("--set", f"teacher.path={teacher_policy(teacher)}") if s == "opd" else ()
                train(root / f"{s}-seed{seed}", s, seed, args.steps, args.every, *extra)
    teacher_acc = curve(teacher)[2][-1]
    plot(runs, teacher_acc, args.out)
    print(f"teacher: {teacher_policy(teacher)} (held-out greedy accuracy {teacher_acc:.3f})")
    print(table(runs))


if __name__ == "__main__":
    main()
