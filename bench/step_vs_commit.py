"""The training step of this tree against another commit's, side by side: is the step no slower?

    nice -n 10 .venv/bin/python bench/step_vs_commit.py --base 4890959      # before issue 58's seams
    nice -n 10 .venv/bin/python bench/step_vs_commit.py --base 4890959 --rounds 6 --specs grpo

The commit's code is taken with ``git archive`` into a temporary folder (its package folders
linked as pyproject.toml's ``package-dir`` maps them), and each side runs its OWN
``bench/step.py`` (the runtime's code path: ``build_run`` then ``train_step`` on the embedded
toy model, 16 prompts x 8 samples, at most 16 new tokens, 1 thread) in a process of its own:
``--warmup`` untimed steps, then ``--steps`` timed ones. The sides alternate in ABBA order for
``--rounds`` rounds, so that the machine's load hits both alike; the table gives each side's
median of the per-round medians of ``step_s`` and their ratio (this tree / the commit: below 1
is faster). Run it on a quiet machine and say the load (``uptime``) beside the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: pyproject.toml's package-dir: the folders that the installed package names differently
LINKS = {"rldsl/runtime": "../runtime", "rldsl/_grammar": "../grammar", "rldsl/_algorithms": "../algorithms"}


def checkout(rev: str, into: Path) -> Path:
    """The tree of ``rev`` in ``into``, importable as ``rldsl`` with its PYTHONPATH at ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for link, target in LINKS.items():
        if not (into / link).exists():
            (into / link).symlink_to(target)
    return into


def one_block(tree: Path, args, out: Path) -> dict[str, float]:
    """spec -> median s/step of one process of ``tree``'s own bench/step.py."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, str(tree / "bench" / "step.py"), "--specs", args.specs, "--steps",
                    str(args.steps), "--blocks", "1", "--warmup", str(args.warmup), "--json", str(out)],
                   check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
    return {Path(r["spec"]).stem: r["step_s"] for r in json.loads(out.read_text())["rows"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare with (a revision git knows)")
    ap.add_argument("--specs", default="grpo,lite_ppo")
    ap.add_argument("--rounds", type=int, default=4, help="ABBA rounds: each side runs once a round")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per process")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per process first (compile)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = checkout(args.base, Path(tmp) / "base")
        sides = {"this tree": ROOT, f"commit {args.base}": base}
        seen: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                seen[name].append(one_block(sides[name], args, Path(tmp) / "step.json"))
    print(f"\n{args.rounds} rounds (ABBA) x {args.steps} timed steps per side, after {args.warmup} warm-up "
          f"steps; load {os.getloadavg()[0]:.2f}")
    print(f"| spec | this tree s/step | commit {args.base} s/step | ratio |")
    print("|---|---|---|---|")
    here, there = seen["this tree"], seen[f"commit {args.base}"]
    for spec in here[0]:
        a = statistics.median(block[spec] for block in here)
        b = statistics.median(block[spec] for block in there)
        print(f"| {spec} | {a:.4f} | {b:.4f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
