"""A mixture-of-experts policy with and without routing replay on the embedded task (docs/moe.md,
"A CPU demo").

    python demos/moe.py [--root runs/moe_demo] [--steps 60] [--lr 3e-4] [--parallel] [--every 10]

1. The policy: a tiny Qwen3-MoE (8 experts, top-2, 4 layers, hidden 96, the toy's character
   vocabulary) warm-started as the toy is (the carry-dropping teacher, supervised, stopped once
   learned, then cached: ``toy.warm_start`` with this model config and ``WARM``, its own cache
   entry).
2. Two runs of GRPO on the addition task from that warm start, the same seed and batches,
   ``rollout.max_staleness=1`` (each batch sampled by the policy one step behind: the routers
   moved since) at a learning rate high enough that the routing moves (``--lr``): one with
   ``rollout.routing_replay=false``, one with ``true``.
3. A markdown table every ``--every`` steps, side by side: the reward, ``moe/routing_mismatch``,
   ``moe/router_drift`` and ``rollout_logprob_diff`` (each the mean over the ``--every`` steps up to
   that row) and the held-out greedy accuracy; each run's wall time.

Runs already finished under ``--root`` are kept (re-running only prints the table); each run is a
child process ``rldsl run ...`` (niced: the machine is shared).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from transformers import Qwen3MoeConfig

from rldsl.runtime.records.metrics import read_metrics
from rldsl.runtime.toy import WarmStartConfig, build_tokenizer, warm_start

GREEDY = "eval/greedy_acc"
COLUMNS = ("reward_mean", "moe/routing_mismatch", "moe/router_drift", "rollout_logprob_diff")


#: The toy's warm-start recipe (the carry-dropping teacher, lr 1e-3, stopped once learned) with a
#: shorter settling and a lower step cap: a sparse block's per-expert loops make a step several
#: times the toy's.
WARM = WarmStartConfig(settle_steps=200, max_steps=2000)


def moe_config() -> Qwen3MoeConfig:
    """The toy's shape (hidden 96, 4 layers, 4 heads of 24, tied embeddings, 64 positions) with each
    MLP a sparse block of 8 experts of 96, top-2 (renormalised, as Qwen3-30B-A3B)."""
    tok = build_tokenizer()
    return Qwen3MoeConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=384, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, head_dim=24, max_position_embeddings=64,
                          tie_word_embeddings=True, attention_dropout=0.0, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          router_aux_loss_coef=0.001, output_router_logits=False, use_sliding_window=False,
                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id)


def rldsl(*args: str) -> list[str]:
    return ["nice", "-n", "10", sys.executable, "-c", "from rldsl.cli import app; app()", "run", *args]


def train(run: Path, model: Path, replay: bool, args: argparse.Namespace) -> tuple[subprocess.Popen, float] | None:
    """The run's child process, started (and its start time); None when it finished before."""
    if (run / "demo_wall_s.json").is_file():
        return None
    cmd = rldsl("grpo", "--seed", str(args.seed), "--steps", str(args.steps), "--out", str(run),
                "--set", f"model.path={model}", "--set", "data.task=addition",
                "--set", f"train.lr={args.lr}", "--set", "rollout.max_staleness=1",
                "--set", f"rollout.routing_replay={str(replay).lower()}",
                "--set", f"eval.every={args.every}", "--set", "checkpoint.every=0", "--set", "log.progress=false")
    print("$", " ".join(cmd[3:]), flush=True)
    return subprocess.Popen(cmd), time.perf_counter()


def wait(run: Path, started: tuple[subprocess.Popen, float] | None) -> None:
    if started is None:
        return
    proc, t = started
    if proc.wait() != 0:
        raise SystemExit(f"{run}: the run failed (exit {proc.returncode})")
    (run / "demo_wall_s.json").write_text(json.dumps({"wall_s": time.perf_counter() - t}))


def table(runs: dict[str, Path], every: int) -> str:
    recs = {name: read_metrics(run) for name, run in runs.items()}
    steps = {name: {r["step"]: r for r in rs if "reward_mean" in r} for name, rs in recs.items()}
    evals = {name: {r["step"]: r[GREEDY] for r in rs if GREEDY in r} for name, rs in recs.items()}
    names = list(runs)
    head = ["steps"] + [f"{c} {n}" for c in ("reward", "`moe/routing_mismatch`", "`moe/router_drift`",
                                            "`rollout_logprob_diff`") for n in names] + \
        [f"held-out greedy acc {n}" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    last = min(max(s) for s in steps.values())
    for end in [0] + list(range(every, last + 1, every)):
        if end == 0:
            cells = ["0"] + ["" for _ in COLUMNS for _ in names]
        else:
            window = range(end - every + 1, end + 1)
            cells = [f"{window[0]}-{end}"]
            for c in COLUMNS:
                for n in names:
                    vals = [steps[n][s][c] for s in window if s in steps[n] and c in steps[n][s]]
                    cells.append(f"{statistics.mean(vals):.3f}" if vals else "-")
        cells += [f"{evals[n][end]:.3f}" if end in evals[n] else "-" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    walls = []
    for n, run in runs.items():
        f = run / "demo_wall_s.json"
        walls.append(f"{n}: {json.loads(f.read_text())['wall_s']:.0f} s" if f.is_file() else f"{n}: -")
    return "\n".join(lines) + "\n\nwall time (whole command): " + ", ".join(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("runs/moe_demo"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--parallel", action="store_true", help="run the two arms at the same time")
    ap.add_argument("--table", action="store_true", help="print the table of the runs already made")
    args = ap.parse_args()
    runs = {"no replay": args.root / "no_replay", "replay": args.root / "replay"}
    if not args.table:
        t = time.perf_counter()
        model = warm_start(WARM, model_config=moe_config(), verbose=True)
        report = json.loads((model / "warm_start.json").read_text())
        print(f"warm start {model} ({time.perf_counter() - t:.0f} s here; trained in {report['seconds']} s, "
              f"{report['steps']} steps, validation greedy accuracy {report['validation_accuracy']})", flush=True)
        if args.parallel:  # both arms at once (each its own process)
            started = {name: train(run, model, name == "replay", args) for name, run in runs.items()}
            for name, run in runs.items():
                wait(run, started[name])
        else:
            for name, run in runs.items():
                wait(run, train(run, model, name == "replay", args))
    print(table(runs, args.every))


if __name__ == "__main__":
    main()
