"""The tool-use demo's figures (docs/tool_use.md): before/after RL of each run folder of
`rldsl run algorithms/lite_ppo.rl --set data.task=calculator --set seed=S ...`.

    python demos/tool_use.py runs/seed1 runs/seed2 runs/seed3

prints one markdown row per run: held-out greedy and sampled accuracy, well-formed tool-call
rate and calls per episode (greedy / sampled episodes) at the first and the last evaluation,
and the mean step time.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from rldsl.runtime.records.metrics import read_metrics

KEYS = [("eval/greedy_acc", "greedy acc"), ("eval/sampled_acc", "sampled acc"),
        ("eval/tool_calls/well_formed", "well-formed (greedy)"),
        ("eval/sampled_tool_calls/well_formed", "well-formed (sampled)"),
        ("eval/sampled_tool_calls/per_episode", "calls/episode (sampled)")]


def row(run: Path) -> str:
    records = read_metrics(run / "metrics.jsonl")
    evals = [r for r in records if "eval/greedy_acc" in r]
    first, last = evals[0], evals[-1]
    steps = [r["step_s"] for r in records if "step_s" in r]
    seed = json.loads((run / "config.json").read_text()).get("seed")

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3f}"
    cells = [f"{fmt(first.get(k))} → {fmt(last.get(k))}" for k, _ in KEYS]
    return (f"| {seed} | {last['step']} | " + " | ".join(cells)
            + f" | {sum(steps) / len(steps):.2f} s |")


if __name__ == "__main__":
    print("| seed | steps | " + " | ".join(name for _, name in KEYS) + " | mean step |")
    print("|---" * (len(KEYS) + 3) + "|")
    for arg in sys.argv[1:]:
        print(row(Path(arg)))
