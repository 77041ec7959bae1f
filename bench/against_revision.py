"""This checkout's training step against an earlier revision's, side by side: same loss, no slower.

    .venv/bin/python bench/against_revision.py --rev 4864746                  # lite_ppo, 3 blocks x 30 steps
    .venv/bin/python bench/against_revision.py --rev 4864746 --specs lite_ppo,grpo --steps 40

A change that must leave the step alone (a refactor, a new input no formula reads, a sampling
component that is off) is checked here: the revision ``--rev`` is unpacked (``git archive``) into a
temporary folder, and ``rldsl run SPEC`` runs from each tree in turn (A, B, A, B ...: machine noise
hits both), with the same seed, model (the embedded toy, warm start from the cache), batch and
settings, each block a fresh process of ``--steps`` steps. Each tree's own code is imported: the
child process maps the packages its ``pyproject.toml`` names (``tool.setuptools.package-dir``) to
that tree before anything imports ``rldsl``, whatever is installed.

Printed per spec:
    s/step       median ``step_s`` over every block's steps after the first ``--skip`` (the
                 compile and the warm caches), per tree, and the ratio this / revision;
    loss         the largest |loss difference| between the two trees at the same step (the
                 runs are seeded: an unchanged step gives 0), and the same for ``reward_mean``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The child: import rldsl from TREE (argv[1]), whatever the environment has installed.
BOOT = r"""
import importlib.abc, importlib.machinery, importlib.util, sys, tomllib
from pathlib import Path
tree = Path(sys.argv.pop(1)).resolve()
dirs = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]

class Tree(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in dirs:
            return None
        folder = tree / dirs[name]
        init = folder / "__init__.py"
        if init.is_file():
            return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        return spec

sys.meta_path.insert(0, Tree())
sys.argv[0] = "rldsl"
from rldsl.cli import app
app()
"""


def unpack(rev: str, into: Path) -> str:
    """The revision's files in ``into``; its full commit hash."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                         check=True, capture_output=True, text=True).stdout.strip()
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", sha], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {sha} failed")
    return sha


def block(tree: Path, spec: str, steps: int, seed: int, out: Path, extra: list[str]) -> list[dict]:
    """One process of ``rldsl run`` from ``tree``; its step records."""
    cmd = [sys.executable, "-c", BOOT, str(tree), "run", spec, "--seed", str(seed), "--steps", str(steps),
           "--out", str(out), "--set", "eval.every=0", "--set", "checkpoint.every=0", *extra]
    done = subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: rldsl run {spec} exited {done.returncode}:\n{done.stderr[-3000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in recs if "step_s" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the earlier revision (any git name of a commit)")
    ap.add_argument("--specs", default="lite_ppo", help="comma-separated library names or .rl paths")
    ap.add_argument("--steps", type=int, default=30, help="steps per block (one process)")
    ap.add_argument("--blocks", type=int, default=3, help="blocks per tree, alternated")
    ap.add_argument("--skip", type=int, default=3, help="first steps of each block not timed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a setting for both trees")
    ap.add_argument("--json", type=Path, help="write the raw figures here")
    args = ap.parse_args()
    extra = [x for s in args.sets for x in ("--set", s)]
    report = {}
    with tempfile.TemporaryDirectory(prefix="rldsl-rev-") as tmp:
        before = Path(tmp) / "revision"
        before.mkdir()
        sha = unpack(args.rev, before)
        trees = {"this checkout": ROOT, f"revision {sha[:9]}": before}
        print(f"this checkout ({ROOT}) against {args.rev} = {sha}; {args.blocks} blocks x {args.steps} steps "
              f"per tree, first {args.skip} of each untimed")
        for spec in args.specs.split(","):
            spec_arg = str((ROOT / spec).resolve()) if spec.endswith(".rl") else spec
            times: dict[str, list[float]] = {name: [] for name in trees}
            series: dict[str, list[dict]] = {}
            for b in range(args.blocks):
                for name, tree in trees.items():
                    out = Path(tmp) / f"{name.split()[0]}-{spec.replace('/', '_')}-{b}"
                    recs = block(tree, spec_arg, args.steps, args.seed, out, extra)
                    times[name] += [r["step_s"] for r in recs[args.skip:]]
                    series.setdefault(name, recs)
            med = {name: statistics.median(t) for name, t in times.items()}
            a, b_ = series.values()
            loss_diff = max((abs(x["loss"] - y["loss"]) for x, y in zip(a, b_) if "loss" in x and "loss" in y),
                            default=float("nan"))
            reward_diff = max(abs(x["reward_mean"] - y["reward_mean"]) for x, y in zip(a, b_))
            this, rev = med.values()
            print(f"\n{spec}: s/step (median of {len(times['this checkout'])} steps each)")
            for name, m in med.items():
                print(f"  {name:24s} {m:.4f}")
            print(f"  ratio this / revision    {this / rev:.3f}")
            print(f"  max |loss difference| over {min(len(a), len(b_))} steps: {loss_diff:.3g}; "
                  f"max |reward_mean difference|: {reward_diff:.3g}")
            report[spec] = {"median_s": med, "ratio": this / rev, "loss_diff": loss_diff, "reward_diff": reward_diff}
    if args.json:
        args.json.write_text(json.dumps({"rev": sha, "specs": report}, indent=2))


if __name__ == "__main__":
    main()
