"""Asynchronous rollouts: seconds per step, tokens per second and held-out accuracy for
rollout.max_staleness K = 0, 1, 2 side by side in one run, and a timeline of what the rollout
producer and the trainer did in each step.

    .venv/bin/python bench/async.py                      # embedded task, lite_ppo, 3 seeds x 150 steps
    .venv/bin/python bench/async.py --task gen-heavy     # a larger random model, 48 new tokens, speed only
    .venv/bin/python bench/async.py --timeline docs/async_timeline.png

``toy``: the demo's task and model (0.59M parameters, <= 4 new tokens), lite_ppo with
``train.minibatches=4``, the same number of samples for every K; the table gives the mean over
seeds of the final held-out greedy accuracy and the median seconds per step (wall clock of
the training step, the producer's work overlapping it). ``gen-heavy``: a random-init Llama
(hidden 256, 4 layers) that rarely stops, so generation dominates the step: speed only.
Runs alternate K = 0, 1, 2 within a seed so machine noise hits all of them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "runtime"))  # reward_helpers (gen-heavy's reward)


def gen_heavy_model(folder: Path) -> Path:
    import torch
    from transformers import LlamaForCausalLM
    from rldsl.runtime import toy
    tok = toy.build_tokenizer()
    cfg = toy.tiny_config(tok, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run_once(task: str, K: int, seed: int, steps: int, out: Path, model: Path | None, record: list | None,
             spec: str | None = None, extra: tuple[str, ...] = ()):
    from rldsl.runtime.run import loop
    from rldsl.runtime.run import schedule
    from rldsl.runtime.rollout import producer as producer_mod
    from rldsl.runtime.config import load_config
    from rldsl.runtime.records.metrics import read_metrics

    sets = [f"out={out}", f"seed={seed}", f"train.steps={steps}", f"rollout.max_staleness={K}",
            "log.progress=false", "checkpoint.every=0", "log.samples_per_step=0"]
    if task == "toy":
        sets += ["train.minibatches=4", f"eval.every={steps}", "eval.samples=0"]
        spec = spec or "lite_ppo"
    else:
        sets += [f"model.path={model}", "rollout.max_new_tokens=48", "rollout.prompts_per_step=8",
                 "rollout.n=4", "eval.every=0", "data.eval_size=0", "reward.name=reward_helpers:parity",
                 "eval.samples=0"]
        spec = spec or "grpo"
    sets += list(extra)
    trainer_spans: list[tuple[int, float, float]] = []
    real_get, real_step = producer_mod.RolloutProducer.get, schedule.train_step
    if record is not None:
        def get(self, step, poll=0.5):
            item = real_get(self, step, poll)
            record.append(("producer", item.step, item.started, item.started + item.generate_s))
            return item

        def step_fn(s, step, producer=None):
            t0 = time.perf_counter()
            m = real_step(s, step, producer)
            record.append(("trainer", step, t0, time.perf_counter()))
            if producer is None:  # synchronous: the rollout is the start of the step
                record.append(("producer", step, t0, t0 + m["time/rollout_s"] + m["time/reward_s"]))
            return m
        producer_mod.RolloutProducer.get = get
        schedule.train_step = step_fn
    try:
        t0 = time.perf_counter()
        run = loop.train(spec, load_config(None, sets))
        wall = time.perf_counter() - t0
    finally:
        producer_mod.RolloutProducer.get, schedule.train_step = real_get, real_step
    recs = read_metrics(run / "metrics.jsonl")
    step_recs = [r for r in recs if "step_s" in r]
    acc = [r["eval/greedy_acc"] for r in recs if "eval/greedy_acc" in r]
    return {"step_s": statistics.median(r["step_s"] for r in step_recs[2:]),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in step_recs[2:]),
            "final_acc": acc[-1] if acc else float("nan"), "wall_s": wall,
            "steps_per_s": len(step_recs) / sum(r["step_s"] for r in step_recs)}


def timeline(record: list, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    Ks = sorted({k for k, _ in record})
    fig, axes = plt.subplots(len(Ks), 1, figsize=(10, 1.6 * len(Ks) + 0.6), squeeze=False)
    for ax, K in zip(axes[:, 0], Ks):
        spans = [r for k, rs in record if k == K for r in rs]
        t0 = min(s[2] for s in spans)
        for lane, color, y in (("producer", "tab:orange", 1), ("trainer", "tab:blue", 0)):
            bars = [(s[2] - t0, s[3] - s[2]) for s in spans if s[0] == lane]
            ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=color, edgecolors="white", linewidth=0.5)
        ax.set_yticks([0, 1], ["trainer step", "generate + score"])
        ax.set_title(f"rollout.max_staleness = {K}", fontsize=9, loc="left")
        ax.set_xlabel("seconds")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["toy", "gen-heavy"], default="toy")
    ap.add_argument("--ks", default="0,1,2")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--timeline", type=Path, default=None, help="PNG of the first seed's activity (last 8 steps)")
    ap.add_argument("--spec", default=None, help="the spec (default: lite_ppo for toy, grpo for gen-heavy); "
                                                 "e.g. grpo_tis, a spec with a correction")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run, e.g. rollout.partial=true (repeatable)")
    args = ap.parse_args()
    os.environ.setdefault("RLDSL_COMPILE", "1")
    Ks = [int(k) for k in args.ks.split(",")]
    results: dict[int, list[dict]] = {K: [] for K in Ks}
    records: list[tuple[int, list]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = gen_heavy_model(Path(tmp) / "model") if args.task == "gen-heavy" else None
        for seed in range(args.seeds):
            for K in Ks:
                rec: list | None = [] if args.timeline is not None and seed == 0 else None
                r = run_once(args.task, K, seed, args.steps, Path(tmp) / f"k{K}-s{seed}", model, rec,
                             args.spec, tuple(args.sets))
                results[K].append(r)
                if rec is not None:
                    last = sorted({s[1] for s in rec})[-8:]
                    records.append((K, [s for s in rec if s[1] in last]))
                print(f"K={K} seed={seed}: {r['step_s']:.3f} s/step, {r['tokens_per_s']:.0f} tok/s, "
                      f"final held-out acc {r['final_acc']:.3f}, wall {r['wall_s']:.1f} s", flush=True)
    base = statistics.median(r["step_s"] for r in results[Ks[0]])
    print(f"\ntask {args.task}, {args.steps} steps, {args.seeds} seeds, torch threads 1 per side, "
          f"{os.cpu_count()} cores")
    print("| K | s/step (median) | vs K=0 | tokens/s | final held-out acc (mean ± std) |")
    print("|---|---|---|---|---|")
    for K in Ks:
        step = statistics.median(r["step_s"] for r in results[K])
        acc = [r["final_acc"] for r in results[K]]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        print(f"| {K} | {step:.3f} | {step / base:.2f}x | "
              f"{statistics.median(r['tokens_per_s'] for r in results[K]):.0f} | "
              f"{statistics.mean(acc):.3f} ± {sd:.3f} |")
    if args.timeline is not None:
        timeline(records, args.timeline, f"{args.task}: producer and trainer, last 8 steps of seed 0")
        print(f"timeline: {args.timeline}")


if __name__ == "__main__":
    main()
