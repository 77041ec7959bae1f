"""The vision-language CPU demo's curve (docs/vlm.md "A CPU demo: a tiny VLM learns to read
pictures"): held-out greedy accuracy per evaluation step of each seed, and their mean.

    python demos/vlm/curve.py runs/vlm_demo                 # seeds 1 2 3, one after the other
    python demos/vlm/curve.py runs/vlm_demo --table         # the table of runs already made

For each seed S it runs (unless DIR/seed-S finished already)

    rldsl run algorithms/lite_ppo.rl --config demos/vlm/shapes.toml --seed S --out DIR/seed-S

and prints a markdown table: per evaluation step, each seed's held-out greedy accuracy (200
held-out scenes) and the mean; then per seed the accuracy by question (colour, side) at the
first and last evaluation, the median step time and the command's wall time. The first run
also warm-starts the embedded model (cached afterwards: its minutes are in that run's wall time).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rldsl.runtime.records.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
SPEC = ["algorithms/lite_ppo.rl", "--config", "demos/vlm/shapes.toml"]
ACC = "eval/greedy_acc"
BY_QUESTION = [("eval/heldout/colour/greedy_acc", "colour"), ("eval/heldout/side/greedy_acc", "side")]


def run(out: Path, seed: int, extra: list[str]) -> None:
    folder = out / f"seed-{seed}"
    if (folder / "wall_s.json").is_file():
        return  # made already
    cmd = [sys.executable, "-m", "rldsl.cli", "run", *SPEC, "--seed", str(seed), "--out", str(folder), *extra]
    print("$", " ".join(cmd[2:]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with (out / f"seed-{seed}.log").open("w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    (folder / "wall_s.json").write_text(json.dumps({"wall_s": time.perf_counter() - t0}))


def table(out: Path, seeds: list[int]) -> str:
    runs = {s: read_metrics(out / f"seed-{s}" / "metrics.jsonl") for s in seeds}
    evals = {s: {r["step"]: r for r in recs if ACC in r} for s, recs in runs.items()}
    steps = sorted(set.intersection(*(set(e) for e in evals.values())))
    lines = ["| step | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
             "|---" * (len(seeds) + 2) + "|"]
    for step in steps:
        accs = [evals[s][step][ACC] for s in seeds]
        lines.append(f"| {step} | " + " | ".join(f"{a:.3f}" for a in accs) + f" | **{sum(accs) / len(accs):.3f}** |")
    lines += ["", "| seed | " + " | ".join(name for _, name in BY_QUESTION) + " | median s/step | wall |",
              "|---" * (len(BY_QUESTION) + 3) + "|"]
    for s in seeds:
        first, last = evals[s][steps[0]], evals[s][steps[-1]]
        step_s = sorted(r["step_s"] for r in runs[s] if "step_s" in r)
        wall = json.loads((out / f"seed-{s}" / "wall_s.json").read_text())["wall_s"]
        cells = [f"{first[k]:.3f} → {last[k]:.3f}" for k, _ in BY_QUESTION]
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {step_s[len(step_s) // 2]:.2f} | "
                     f"{int(wall // 60)} min {wall % 60:02.0f} s |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--table", action="store_true", help="print the table of the runs in OUT only")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run (rldsl run --set)")
    args = ap.parse_args()
    if not args.table:
        for seed in args.seeds:
            run(args.out, seed, [a for kv in args.sets for a in ("--set", kv)])
    print(table(args.out, args.seeds))


if __name__ == "__main__":
    main()
