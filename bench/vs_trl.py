"""rldsl vs TRL's ``GRPOTrainer``: seconds per step and peak memory on the same work.

    .venv/bin/pip install -c constraints/cpu.txt -e ".[bench]"      # TRL (optional extra)
    .venv/bin/python bench/vs_trl.py                  # 3 blocks x 25 steps per side, ~4 min
    .venv/bin/python bench/vs_trl.py --steps 15 --blocks 2   # quicker

The work (identical on both sides)
    model      the embedded toy Llama (0.59M params, fp32), warm-started by
               ``rldsl.runtime.toy.warm_start()`` (cached; no download)
    task       2-digit addition; the prompts of each step are the ones rldsl's
               ``PromptSource(seed)`` deals, handed to TRL in that order (no shuffle)
    batch      16 prompts x 8 samples, temperature 1, top_p 1, top_k 0, at most 16 new
               tokens (``max_new_tokens=16`` / ``max_completion_length=16``); no
               ``min_new_tokens``: both sides call transformers ``generate``, which stops a
               row at its first EOS and stops the batch once every row has one; the loss mask
               keeps the first EOS and nothing after it (both sides). The mean completion
               lengths are printed, so one can see that both did the same amount of work.
    reward     1 only for exactly the sum followed by EOS (TRL: decoded text == answer and
               the last completion id is EOS; rldsl: the built-in ``addition`` reward)
    loss       DAPO-style: group-mean baseline / (group std + 1e-4) (TRL scale_rewards=
               "group"), token-level PPO clip 0.2 / 0.28, global token mean (TRL loss_type=
               "dapo"), beta 0, one update per rollout (num_iterations=1) -- rldsl:
               ``bench/dapo_like.rl`` (``extends dapo``, ``sampling once``, ``shaping none``)
    optimizer  AdamW (torch's fused kernel: TRL's default ``adamw_torch_fused``, rldsl's own
               default) lr 3e-4, betas (0.9, 0.99), eps 1e-8, no weight decay, constant lr,
               grad clip 1.0
    threads    ``torch.set_num_threads(1)`` on both sides

How it is measured
    Each side runs in its own subprocess, ``--steps`` training steps per run, and the runs
    alternate A, B, A, B ... (``--blocks`` of each) so that machine noise hits both.
    rldsl is the real CLI, ``rldsl run bench/dapo_like.rl``; its per-step time is
    ``step_s`` of ``metrics.jsonl`` (rollout + reward + logprob recompute + update + weight
    sync). TRL runs ``GRPOTrainer.train()``; its per-step time is the interval between a
    ``TrainerCallback``'s ``on_step_begin`` and ``on_step_end`` (generation + reward +
    advantages + forward/backward + grad clip + optimizer step). Neither includes metric
    logging, evaluation or checkpoints (both disabled). The first ``--warmup`` steps of
    every run are dropped (rldsl's torch.compile warm-up, TRL's first-step lazy init).
    Peak memory: the RSS high-water mark (``ru_maxrss`` from ``os.wait4`` on that very
    child) of each run, reported as the median over blocks; the worker also reports its
    RSS just before the first step (``/proc/self/statm``), so "peak - before" is the
    memory the training steps themselves added.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "bench" / "dapo_like.rl"
P, G, MAX_NEW = 16, 8, 16
LR, BETAS, EPS, CLIP = 3e-4, (0.9, 0.99), 1e-8, 1.0


def _rss_now() -> int:
    """Current resident set size in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ----------------------------------------------------------------------------- TRL worker

def trl_worker(steps: int, out: Path, seed: int, threads: int, grad_ckpt: bool = False) -> None:
    import torch
    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rldsl.runtime.toy import AdditionTask, load_warm_start, warm_start

    model, tok = load_warm_start(warm_start())
    tok.padding_side = "left"
    eos = tok.eos_token_id
    # the prompts rldsl deals for steps 0..steps-1, in that order
    source = AdditionTask().prompt_source(seed)
    rows = [e for _ in range(steps) for e in source.next_batch(P)]
    ds = Dataset.from_dict({"prompt": [e.prompt for e in rows], "answer": [e.answer for e in rows]})

    def addition(prompts, completions, completion_ids, answer, **_):
        return [float(c == a and len(ids) > 0 and ids[-1] == eos)
                for c, ids, a in zip(completions, completion_ids, answer)]

    args = GRPOConfig(
        output_dir=str(out / "trl"), report_to="none", use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=P * G, num_generations=G, steps_per_generation=1,
        gradient_accumulation_steps=1, num_iterations=1, max_completion_length=MAX_NEW,
        temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
        beta=0.0, scale_rewards="group", learning_rate=LR, adam_beta1=BETAS[0],
        adam_beta2=BETAS[1], adam_epsilon=EPS, weight_decay=0.0, optim="adamw_torch_fused",
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=CLIP, max_steps=steps,
        logging_steps=1, save_strategy="no", eval_strategy="no", shuffle_dataset=False,
        seed=seed, dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
        # TRL's GRPOConfig defaults to activation checkpointing (an extra forward per
        # step); rldsl recomputes no activations, so it is off here unless asked for
        gradient_checkpointing=grad_ckpt,
    )

    class Timer(TrainerCallback):
        def __init__(self):
            self.t0 = 0.0
            self.step_s: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_s.append(time.perf_counter() - self.t0)

    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=addition, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[timer])
    rss_before = _rss_now()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    (out / "result.json").write_text(json.dumps({
        "step_s": timer.step_s,
        "completion_length": [h["completions/mean_length"] for h in logs],
        "reward": [h.get("reward", float("nan")) for h in logs],
        "threads": torch.get_num_threads(),
        "rss_before_steps": rss_before,
    }))


# ----------------------------------------------------------------------------- rldsl side

def rldsl_command(steps: int, out: Path, seed: int, threads: int) -> list[str]:
    exe = Path(sys.executable).with_name("rldsl")
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "rldsl.cli"]
    sets = {
        "rollout.prompts_per_step": P, "rollout.n": G, "rollout.max_new_tokens": MAX_NEW,
        "rollout.temperature": 1.0, "rollout.top_p": 1.0,
        "train.lr": LR, "train.betas": f"{BETAS[0]},{BETAS[1]}", "train.eps": EPS,
        "train.weight_decay": 0.0, "train.grad_clip": CLIP, "train.ppo_epochs": 1,
        "train.minibatches": 1, "train.lr_schedule": "constant",
        # TRL steps the optimizer even when every advantage is 0; so does rldsl here
        "train.skip_zero_advantage": "false",
        "threads": threads, "data.eval_size": 0, "eval.every": 0, "eval.samples": 0,
        "checkpoint.every": 0, "checkpoint.save_final": "false", "log.progress": "false",
    }
    cmd = head + ["run", str(SPEC), "--steps", str(steps), "--seed", str(seed), "--out", str(out / "run")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd


def read_rldsl(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_s" in r]
    return {"step_s": [r["step_s"] for r in rows],
            "completion_length": [r["response_length"] for r in rows],
            "reward": [r["reward_mean"] for r in rows]}


# ----------------------------------------------------------------------------- controller

def run_child(cmd: list[str], env: dict) -> tuple[int, float, str]:
    """Run ``cmd``; return (peak RSS bytes of that child, wall seconds, captured output)."""
    t0 = time.perf_counter()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    log.seek(0)
    text = log.read()
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{text[-4000:]}")
    return usage.ru_maxrss * 1024, wall, text  # ru_maxrss is in KiB on Linux


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=25, help="training steps per run (block)")
    ap.add_argument("--blocks", type=int, default=3, help="runs of each side, alternated A B A B ...")
    ap.add_argument("--warmup", type=int, default=3, help="steps dropped at the start of every run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-gradient-checkpointing", action="store_true",
                    help="keep TRL's default activation checkpointing (off by default: less work for TRL)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw figures here")
    ap.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "trl":
        trl_worker(a.steps, a.out, a.seed, a.threads, a.trl_gradient_checkpointing)
        return
    if a.steps <= a.warmup:
        raise SystemExit("--steps must exceed --warmup")
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit('TRL is not installed: .venv/bin/pip install -c constraints/cpu.txt -e ".[bench]"')

    from rldsl.runtime.toy import warm_start
    warm_start(verbose=True)  # build the cache once, outside the timed runs

    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    res = {"rldsl": [], "trl": []}
    tmp = Path(tempfile.mkdtemp(prefix="rldsl-vs-trl-"))
    try:
        for b in range(a.blocks):
            for side in ("trl", "rldsl"):
                out = tmp / f"{side}-{b}"
                out.mkdir()
                if side == "trl":
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "trl", "--steps",
                           str(a.steps), "--out", str(out), "--seed", str(a.seed), "--threads", str(a.threads)]
                    if a.trl_gradient_checkpointing:
                        cmd.append("--trl-gradient-checkpointing")
                else:
                    cmd = rldsl_command(a.steps, out, a.seed, a.threads)
                peak, wall, _ = run_child(cmd, env)
                r = json.loads((out / "result.json").read_text()) if side == "trl" else read_rldsl(out)
                if len(r["step_s"]) != a.steps:
                    raise SystemExit(f"{side}: {len(r['step_s'])} step times for {a.steps} steps")
                r.update(peak_rss=peak, wall_s=wall, block=b)
                res[side].append(r)
                kept = r["step_s"][a.warmup:]
                print(f"block {b} {side:5s}: median {med(kept):.4f} s/step over {len(kept)} steps, "
                      f"first step {r['step_s'][0]:.2f} s, mean completion length "
                      f"{statistics.mean(r['completion_length']):.2f}, peak RSS {peak / 2**20:.0f} MiB, "
                      f"process wall {wall:.1f} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    summary = {}
    for side, runs in res.items():
        kept = [s for r in runs for s in r["step_s"][a.warmup:]]
        summary[side] = {
            "median_step_s": med(kept),
            "p10_step_s": sorted(kept)[len(kept) // 10], "p90_step_s": sorted(kept)[(9 * len(kept)) // 10],
            "block_medians": [med(r["step_s"][a.warmup:]) for r in runs],
            "steps_timed": len(kept),
            "mean_completion_length": statistics.mean(x for r in runs for x in r["completion_length"]),
            "mean_reward": statistics.mean(x for r in runs for x in r["reward"] if x == x),
            "peak_rss_mib": med([r["peak_rss"] for r in runs]) / 2**20,
        }
        if side == "trl":
            summary[side]["rss_before_steps_mib"] = med([r["rss_before_steps"] for r in runs]) / 2**20
    ratio = summary["rldsl"]["median_step_s"] / summary["trl"]["median_step_s"]
    mem_ratio = summary["rldsl"]["peak_rss_mib"] / summary["trl"]["peak_rss_mib"]
    print()
    print(f"same work: {P} prompts x {G} samples, <= {MAX_NEW} new tokens, {a.threads} thread(s); "
          f"{a.blocks} runs x {a.steps} steps per side, alternated, first {a.warmup} steps of each run dropped")
    print(f"| | median s/step (p10-p90) | per-run medians | mean completion tokens | mean reward | peak RSS |")
    print(f"|---|---|---|---|---|---|")
    for side, name in (("trl", f"TRL {__import__('trl').__version__} GRPOTrainer"), ("rldsl", "rldsl run")):
        s = summary[side]
        print(f"| {name} | {s['median_step_s']:.4f} ({s['p10_step_s']:.4f}-{s['p90_step_s']:.4f}) | "
              f"{', '.join(f'{x:.4f}' for x in s['block_medians'])} | {s['mean_completion_length']:.2f} | "
              f"{s['mean_reward']:.3f} | {s['peak_rss_mib']:.0f} MiB |")
    print(f"\nrldsl / TRL seconds per step: {ratio:.3f}  (TRL / rldsl: {1 / ratio:.2f}x)")
    print(f"rldsl / TRL peak RSS: {mem_ratio:.3f}")
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "summary": summary,
                                      "ratio_step_s": ratio, "ratio_peak_rss": mem_ratio,
                                      "runs": res}, indent=1, default=str))


if __name__ == "__main__":
    main()
