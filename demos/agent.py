"""The tool-use demo as an --agent against the built-in tool episodes (docs/agents.md,
"Measured: an agent learns like the built-in episodes").

    python demos/agent.py runs/agent_demo            # both commands, seeds 1 2 3, one at a time
    python demos/agent.py runs/agent_demo --steps 20 # shorter runs (docs/agents.md's table)
    python demos/agent.py runs/agent_demo --table    # the table of runs already made

For each seed S it runs, one after the other (built-in first, then the agent, so the two of a
seed share the machine's load):

    rldsl run algorithms/lite_ppo.rl --set data.task=calculator --set seed=S \\
        --set train.steps=60 --set eval.every=10 --out DIR/builtin-S
    rldsl run algorithms/lite_ppo.rl --set data.task=calculator --set seed=S \\
        --set train.steps=60 --set eval.every=10 --out DIR/agent-S \\
        --agent examples/calculator_agent.py:solve --reward addition

(the built-in demo's command of docs/tool_use.md, then the same with examples/calculator_agent.py,
an ordinary openai-client tool loop, in place of the built-in episodes) and prints one markdown
row per run: held-out greedy and sampled accuracy (200 prompts) at the first and last evaluation, model calls
per episode (sampled: the built-in episodes count tool calls, the agent model calls, its final
answer included), the median step time (the first step of a process includes torch.compile's
warm-up) and the command's wall time.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rldsl.runtime.records.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
BASE = ["algorithms/lite_ppo.rl", "--set", "data.task=calculator", "--set", "eval.every=10"]
AGENT = ["--agent", "examples/calculator_agent.py:solve", "--reward", "addition"]
KEYS = [("eval/greedy_acc", "greedy acc"), ("eval/sampled_acc", "sampled acc")]
#: calls per sampled held-out episode: the built-in episodes count tool calls, the agent model calls
CALLS = {"builtin": "eval/sampled_tool_calls/per_episode", "agent": "eval/sampled_agent/calls"}


def run(out: Path, kind: str, seed: int, steps: int) -> None:
    folder = out / f"{kind}-{seed}"
    if (folder / "metrics.jsonl").is_file() and (folder / "wall_s.json").is_file():
        return  # made already
    cmd = [sys.executable, "-m", "rldsl.cli", "run", *BASE, "--set", f"train.steps={steps}", "--set", f"seed={seed}",
           "--out", str(folder),
           *(AGENT if kind == "agent" else [])]
    print("$", " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{kind}-{seed}.log").open("w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    (folder / "wall_s.json").write_text(json.dumps({"wall_s": time.perf_counter() - t0}))


def row(folder: Path, kind: str) -> str:
    records = read_metrics(folder / "metrics.jsonl")
    evals = [r for r in records if "eval/greedy_acc" in r]
    first, last = evals[0], evals[-1]
    steps = sorted(r["step_s"] for r in records if "step_s" in r)
    seed = json.loads((folder / "config.json").read_text()).get("seed")
    wall = json.loads((folder / "wall_s.json").read_text())["wall_s"]

    def fmt(v: float | None, digits: int = 3) -> str:
        return "n/a" if v is None else f"{v:.{digits}f}"
    cells = [f"{fmt(first.get(k))} → {fmt(last.get(k))}" for k, _ in KEYS]
    calls = f"{fmt(first.get(CALLS[kind]), 2)} → {fmt(last.get(CALLS[kind]), 2)}"
    return (f"| {kind} | {seed} | {last['step']} | " + " | ".join(cells) + f" | {calls} | "
            f"{steps[len(steps) // 2]:.2f} | {int(wall // 60)} min {wall % 60:02.0f} s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=60, help="train.steps of every run (docs/tool_use.md: 60)")
    ap.add_argument("--table", action="store_true", help="print the table of the runs in OUT only")
    args = ap.parse_args()
    if not args.table:
        for seed in args.seeds:
            for kind in ("builtin", "agent"):
                run(args.out, kind, seed, args.steps)
    print("| episodes | seed | steps | " + " | ".join(name for _, name in KEYS)
          + " | calls / episode (sampled) | median s / step | wall time |")
    print("|---" * (len(KEYS) + 6) + "|")
    for seed in args.seeds:
        for kind in ("builtin", "agent"):
            folder = args.out / f"{kind}-{seed}"
            if (folder / "wall_s.json").is_file():
                print(row(folder, kind))


if __name__ == "__main__":
    main()
