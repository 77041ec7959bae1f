"""Wall time of the language commands (`rldsl --help`, list, check, explain, translate), each the
best of N fresh processes, beside Python's own start and `import torch` for scale.

    .venv/bin/python bench/cli_startup.py            # 7 runs of each
    .venv/bin/python bench/cli_startup.py --runs 15 --json cli.json

The best of N is what an idle machine gives; a busy one only adds to it. The first run of each
command is dropped (it writes the bytecode caches and the grammar tables: rldsl/parse_tables.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RLDSL = [sys.executable, "-m", "rldsl.cli"]

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "rldsl --help": RLDSL + ["--help"],
    "rldsl list": RLDSL + ["list"],
    "rldsl check algorithms/grpo.rl": RLDSL + ["check", "algorithms/grpo.rl"],
    "rldsl explain algorithms/grpo.rl": RLDSL + ["explain", "algorithms/grpo.rl"],
    "rldsl explain grpo dapo": RLDSL + ["explain", "grpo", "dapo"],
    "rldsl translate tests/translate/trl_grpo.yaml": RLDSL + ["translate", "tests/translate/trl_grpo.yaml"],
}


def wall(cmd: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as a user's machine runs it: bytecode is cached
    results = {}
    print(f"{'command':<48} {'best s':>7} {'median s':>9}")
    for name, cmd in COMMANDS.items():
        wall(cmd, env)  # warm: bytecode, grammar tables, the page cache
        times = sorted(wall(cmd, env) for _ in range(args.runs))
        results[name] = {"best_s": times[0], "median_s": times[len(times) // 2], "runs": times}
        print(f"{name:<48} {times[0]:7.3f} {times[len(times) // 2]:9.3f}", flush=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "loadavg": load}, indent=1))


if __name__ == "__main__":
    main()
