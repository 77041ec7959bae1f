"""What each fault costs a run: the figures of docs/reliability.md.

Each scenario starts `rldsl run lite_ppo` on the embedded default (the toy), injects one fault
at a named point (runtime/faults.py: ``RLDSL_FAULT``), then runs `rldsl run --resume` to the
end, and reports: the steps lost (logged before the fault, redone after it), the sample records
lost (records of steps up to the checkpoint resumed from that the resumed run does not have:
must be 0), the seconds of training work redone (the redone steps' ``step_s``), and the
recovery time (from the resume command's start to its first step starting: process start,
model build, checkpoint check and load). Every run is also checked: each step logged once.

    python demos/faults.py [--steps 8] [--every 3] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

K1 = ["rollout.max_staleness=1"]
PARTIAL = ["rollout.max_staleness=1", "rollout.partial=true"]
#: name -> (fault, extra --set values, expected exit code of the faulted run)
SCENARIOS = {
    "kill in generation": ("generate@5:kill", [], -9),
    "kill in the update": ("update@5:kill", [], -9),
    "kill in the weight sync": ("sync@5:kill", [], -9),
    "kill between steps": ("step@5:kill", [], -9),
    "kill mid-checkpoint-write": ("checkpoint@6:kill", [], -9),
    "Ctrl-C in the update": ("update@5:interrupt", [], 130),
    "kill before the first checkpoint": ("update@2:kill", [], -9),
    "K=1: kill in generation": ("generate@5:kill", K1, -9),
    "K=1: kill in scoring": ("score@5:kill", K1, -9),
    "K=1: Ctrl-C in the update": ("update@5:interrupt", K1, 130),
    "partial: kill in generation": ("generate@5:kill", PARTIAL, -9),
    "partial: Ctrl-C in the update": ("update@5:interrupt", PARTIAL, 130),
    "damaged newest checkpoint (a flipped byte)": (None, [], 0),
}


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "rldsl.cli", *args]


def _default_sigint() -> None:  # Ctrl-C as a foreground job has it, whatever this shell does
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def scenario(name: str, work: Path, steps: int, every: int) -> dict:
    fault, sets, code = SCENARIOS[name]
    run = work / "run"
    args = ["run", "lite_ppo", "--out", str(run), "--steps", str(steps), "--set", f"checkpoint.every={every}",
            "--set", "log.progress=false", "--set", "eval.every=0"]
    for s in sets:
        args += ["--set", s]
    env = dict(os.environ)
    first = subprocess.run(cli(args), env={**env, **({"RLDSL_FAULT": fault} if fault else {})},
                           capture_output=True, text=True, preexec_fn=_default_sigint)
    assert first.returncode == code, (name, first.returncode, first.stderr[-2000:])
    if fault is None:  # a finished run whose newest checkpoint is then damaged
        f = run / "checkpoints" / f"step-{steps}" / "policy" / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))
    before = [r for r in records(run / "metrics.jsonl") if "reward_mean" in r]
    samples_before = records(run / "samples.jsonl")
    logged = max((r["step"] for r in before), default=0)
    ckpts = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*")) \
        if (run / "checkpoints").exists() else []
    t0 = time.monotonic()
    proc = subprocess.Popen(cli(["run", "--resume", str(run)]), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    recovery = None
    while proc.poll() is None:  # a measurement, not a test: polling the file is what we want
        if recovery is None:
            new = [r for r in records(run / "metrics.jsonl") if "reward_mean" in r and r not in before]
            if new:  # the resumed run's first step: when it started
                recovery = time.monotonic() - t0 - new[0]["step_s"]
        time.sleep(0.05)
    out = proc.stdout.read()
    assert proc.returncode == 0, (name, out[-2000:])
    after = [r for r in records(run / "metrics.jsonl") if "reward_mean" in r]
    numbers = [r["step"] for r in records(run / "metrics.jsonl")]
    assert numbers in (list(range(steps + 1)), list(range(1, steps + 1))), (name, numbers)  # each step once
    start = next(r["step"] for r in after if r not in before) - 1  # the checkpoint resumed from
    redone = [r for r in after if start < r["step"] <= logged]
    kept = {(s["step"], s["group"], s["completion"]) for s in records(run / "samples.jsonl")}
    lost_samples = sum(1 for s in samples_before if s["step"] <= start
                       and (s["step"], s["group"], s["completion"]) not in kept)
    return {"scenario": name, "fault": fault or f"a flipped byte in step-{steps}'s weights",
            "checkpoints": ckpts, "resumed from": start, "steps lost": max(0, logged - start),
            "samples lost": lost_samples, "work redone s": round(sum(r["step_s"] for r in redone), 2),
            "recovery s": None if recovery is None else round(recovery, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    for name in a.only or SCENARIOS:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(scenario(name, Path(tmp), a.steps, a.every)), flush=True)


if __name__ == "__main__":
    main()
