"""Step time at fixed lengths, per phase: rldsl vs TRL's ``GRPOTrainer`` at three model sizes,
side by side in one run -- and the regression guard that compares rldsl's phases with a
recorded baseline.

    .venv/bin/python bench/step_phases.py                         # tiny, mid, large; both sides
    .venv/bin/python bench/step_phases.py --sizes tiny,mid --steps 4 --blocks 1
    .venv/bin/python bench/step_phases.py --rldsl-only --baseline bench/baseline.json   # the guard
    .venv/bin/python bench/step_phases.py --rldsl-only --record bench/baseline.json     # new baseline
    .venv/bin/python bench/step_phases.py --lengths lognormal --sizes tiny,mid   # long-tailed answers

Long-tailed lengths (``--lengths lognormal``): answers drawn log-normal with median N / 8 between
2 tokens and the limit N, the same draws on both sides (bench/forced_lengths.py: each answer's
EOS injected at its drawn length while sampling, so each side samples as it does at free
lengths: rldsl's sampler drops finished rows, TRL's ``generate`` carries them to the longest).
rldsl then runs twice, padded (``rldsl``) and with ``train.packing=true`` (``rldsl-packed``),
and the floor counts the real tokens sampled and trained.

Why fixed lengths: at free lengths the two sides' answers grow and shrink with training, so a
step-time ratio mixes speed with training dynamics. Here every sample has exactly
``max_new_tokens`` tokens on both sides: no stop token is sampled before it (rldsl
``rollout.min_new_tokens``, TRL ``generation_kwargs={"min_new_tokens": N}``, the same
``min_new_tokens`` of transformers' generate).

The work (identical on both sides, per size)
    model      a random-init Llama with the toy tokenizer (char level), fp32, saved once
               tiny:  hidden 64,  2 layers, 2 heads,  16 new tokens, 16 prompts x 8
               mid:   hidden 256, 4 layers, 4 heads, 128 new tokens,  8 prompts x 8
               large: hidden 512, 8 layers, 8 heads, 256 new tokens,  4 prompts x 8
    prompts    the built-in addition task's, in rldsl's order (TRL gets them unshuffled)
    reward     ``digit_parity`` below (the parity of the number of digits written): mixed
               rewards from any model, so no group is all-equal and both sides update
    loss       bench/dapo_like.rl = TRL loss_type="dapo", scale_rewards="group", clip 0.2 / 0.28,
               beta 0, one update per rollout (num_iterations=1), AdamW lr 3e-4, grad clip 1,
               no activation checkpointing on either side; 1 torch thread per side

Phases
    rldsl   metrics.jsonl per step: generate (time/rollout_s), reward (time/reward_s), old/ref
            logprobs (time/logprobs_s), update (time/update_s: forward + backward + optimizer),
            sync (time/sync_s), overhead (step_s minus those).
    TRL     by wrapping its methods: generate (``_generate``), old/ref logprobs
            (``_get_per_token_logps_and_entropies`` called while the batch is prepared),
            reward + prep (the rest of ``_generate_and_score_completions``), update (the rest
            of the step: ``compute_loss`` forward, backward, clip, optimizer), step time from a
            callback's on_step_begin / on_step_end.
The floor (printed under each table): the step's matrix products, counted -- forward 2 N,
backward 4 N flops per token trained, 2 N per token sampled, N the model's linear weights, the
shared prompt counted once per group, attention and every element-wise op left out -- divided by
the best fp32 matmul rate this machine reaches on one thread (measured at the start and again
after each size's runs, on the model's own shapes and a large square; the best so far is used,
so a rate drawn low once under a passing load does not flatter the ratios). No implementation of the same step in fp32 on one core
can be faster; when the floor is above half of TRL's step, the 0.5x target is out of reach here.

The first ``--warmup`` steps of every run are dropped (torch.compile, lazy init); runs alternate
TRL, rldsl, TRL, rldsl ... (``--blocks``) and the medians are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "bench" / "dapo_like.rl"
LR, BETAS, EPS, CLIP = 3e-4, (0.9, 0.99), 1e-8, 1.0
SIZES = {  # hidden, layers, heads, new tokens, prompts, samples per prompt
    "tiny": (64, 2, 2, 16, 16, 8),
    "mid": (256, 4, 4, 128, 8, 8),
    "large": (512, 8, 8, 256, 4, 8),
}
PHASES = ("generate", "reward", "logprobs", "update", "sync", "overhead")


def digit_parity(prompt: str, completion: str, answer: str) -> float:
    """1 when the completion holds an odd number of digits: mixed rewards from any model."""
    return float(sum(c.isdigit() for c in completion) % 2)


def make_model(size: str, folder: Path, dims: tuple | None = None) -> Path:
    """The random-init Llama of ``size`` (``dims``, as SIZES' rows, for another), saved to ``folder``."""
    import torch
    from transformers import LlamaForCausalLM
    from rldsl.runtime import toy
    hidden, layers, heads, new, _, _ = dims or SIZES[size]
    tok = toy.build_tokenizer()
    cfg = toy.tiny_config(tok, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                          intermediate_size=4 * hidden, max_position_embeddings=new + 32)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- workers
def trl_worker(size: str, model: Path, steps: int, out: Path, seed: int, lengths: str = "fixed") -> None:
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rldsl.runtime.toy import AdditionTask

    _, _, _, new, P, G = SIZES[size]
    policy = AutoModelForCausalLM.from_pretrained(model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    source = AdditionTask().prompt_source(seed)
    rows = [e for _ in range(steps) for e in source.next_batch(P)]
    ds = Dataset.from_dict({"prompt": [e.prompt for e in rows], "answer": [e.answer for e in rows]})

    def reward(prompts, completions, **_):
        return [digit_parity(p, c, "") for p, c in zip(prompts, completions)]

    args = GRPOConfig(
        output_dir=str(out / "trl"), report_to="none", use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=P * G, num_generations=G, steps_per_generation=1,
        gradient_accumulation_steps=1, num_iterations=1, max_completion_length=new,
        generation_kwargs={"min_new_tokens": new} if lengths == "fixed" else {},
        temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
        beta=0.0, scale_rewards="group", learning_rate=LR, adam_beta1=BETAS[0],
        adam_beta2=BETAS[1], adam_epsilon=EPS, weight_decay=0.0, optim="adamw_torch_fused",
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=CLIP, max_steps=steps,
        logging_steps=1, save_strategy="no", eval_strategy="no", shuffle_dataset=False,
        seed=seed, dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
        gradient_checkpointing=False,
    )
    phase = {"generate": 0.0, "logprobs": 0.0, "prepare": 0.0}
    inside = {"prepare": False}
    steps_out: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()
            for k in phase:
                phase[k] = 0.0

        def on_step_end(self, args, state, control, **kw):
            step_s = time.perf_counter() - self.t0
            steps_out.append({"step_s": step_s, "generate": phase["generate"], "logprobs": phase["logprobs"],
                              "reward": phase["prepare"] - phase["generate"] - phase["logprobs"],
                              "update": step_s - phase["prepare"], "sync": 0.0, "overhead": 0.0})

    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[Timer()])

    def timed(name, fn, only_in_prepare=False):
        def wrapper(*a, **k):
            if only_in_prepare and not inside["prepare"]:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                if name == "prepare":
                    inside["prepare"] = True
                return fn(*a, **k)
            finally:
                if name == "prepare":
                    inside["prepare"] = False
                phase[name] += time.perf_counter() - t0
        return wrapper

    if lengths == "lognormal":
        sys.path.insert(0, str(ROOT / "bench"))
        from forced_lengths import install_trl
        install_trl(trainer, seed, new)
    trainer._generate = timed("generate", trainer._generate)
    trainer._get_per_token_logps_and_entropies = timed("logprobs", trainer._get_per_token_logps_and_entropies,
                                                       only_in_prepare=True)
    trainer._generate_and_score_completions = timed("prepare", trainer._generate_and_score_completions)
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    (out / "result.json").write_text(json.dumps({"steps": steps_out, "completion_length": lengths}))


def rldsl_command(size: str, model: Path, steps: int, out: Path, seed: int, lengths: str = "fixed",
                  packing: bool = False) -> list[str]:
    _, _, _, new, P, G = SIZES[size]
    exe = Path(sys.executable).with_name("rldsl")
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "rldsl.cli"]
    if lengths == "lognormal":  # the same command, answers ended at the drawn lengths
        head = [sys.executable, str(ROOT / "bench" / "forced_lengths.py"), str(seed)]
    sets = {
        "model.path": model, "rollout.prompts_per_step": P, "rollout.n": G, "rollout.max_new_tokens": new,
        "rollout.min_new_tokens": new if lengths == "fixed" else 0, "rollout.temperature": 1.0, "rollout.top_p": 1.0,
        "reward.name": f"{Path(__file__).resolve()}:digit_parity",
        "train.lr": LR, "train.betas": f"{BETAS[0]},{BETAS[1]}", "train.eps": EPS,
        "train.weight_decay": 0.0, "train.grad_clip": CLIP, "train.ppo_epochs": 1,
        "train.minibatches": 1, "train.lr_schedule": "constant", "train.skip_zero_advantage": "false",
        "threads": 1, "data.eval_size": 0, "eval.every": 0, "eval.samples": 0,
        "checkpoint.every": 0, "checkpoint.save_final": "false", "log.progress": "false",
        "log.samples_per_step": 0, "train.packing": str(packing).lower(),
    }
    cmd = head + ["run", str(SPEC), "--steps", str(steps), "--seed", str(seed), "--out", str(out / "run")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd


def read_rldsl(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = []
    for r in (r for r in rows if "step_s" in r):
        p = {"generate": r["time/rollout_s"], "reward": r["time/reward_s"], "logprobs": r["time/logprobs_s"],
             "update": r["time/update_s"], "sync": r["time/sync_s"]}
        p["overhead"] = r["step_s"] - sum(p.values())
        steps.append({"step_s": r["step_s"], **p})
    return {"steps": steps, "completion_length": [r["response_length"] for r in rows if "response_length" in r]}


# ----------------------------------------------------------------------------- the floor
def matmul_peak(sizes: list[str]) -> float:
    """The best fp32 matmul rate (flop/s) of one thread here, over the sizes' own shapes
    (B*T x H times H x 4H, both ways) and a 2048^3 square."""
    import torch
    torch.set_num_threads(1)
    shapes = [(2048, 2048, 2048)]
    for size in sizes:
        hidden = SIZES[size][0]
        shapes += [(8192, hidden, 4 * hidden), (8192, 4 * hidden, hidden)]
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b
        t0 = time.perf_counter()
        for _ in range(3):
            a @ b
        best = max(best, 3 * 2 * m * k * n / (time.perf_counter() - t0))
    return best


def matmul_flops(size: str, model: Path, lengths: str = "fixed", seed: int = 0, steps: int = 0,
                 warmup: int = 0) -> dict:
    """The step's matrix-product flops: linear weights N (embeddings excluded, the LM head
    included), the addition task's mean prompt length Tp over the run's prompts; with long-tailed
    lengths, the mean over the measured steps of the drawn answer tokens."""
    from transformers import AutoConfig, AutoTokenizer
    from rldsl.runtime.toy import AdditionTask
    cfg = AutoConfig.from_pretrained(model)
    tok = AutoTokenizer.from_pretrained(model)
    hidden, layers, heads, new, P, G = SIZES[size]
    kv = hidden // heads * getattr(cfg, "num_key_value_heads", heads)
    inter = cfg.intermediate_size
    N = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter) + cfg.vocab_size * hidden
    prompts = [e.prompt for e in AdditionTask().prompt_source(0).next_batch(P)]
    Tp = statistics.mean(len(tok(p)["input_ids"]) for p in prompts)
    B = P * G
    answers = B * new
    if lengths == "lognormal":
        sys.path.insert(0, str(ROOT / "bench"))
        from forced_lengths import lengths as drawn
        answers = statistics.mean(sum(drawn(seed, c, B, new)) for c in range(warmup, steps))
    trained = P * Tp + answers  # the shared prompt once per group, every real response token
    sampled = P * Tp + answers - B  # prefill once per prompt, then a token at a time until each EOS
    return {"N": N, "Tp": Tp, "update": 6 * N * trained, "generate": 2 * N * sampled}


# ----------------------------------------------------------------------------- controller
def run_child(cmd: list[str], env: dict) -> None:
    log = tempfile.TemporaryFile(mode="w+")
    code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    if code != 0:
        log.seek(0)
        raise SystemExit(f"command failed ({code}): {' '.join(map(str, cmd))}\n{log.read()[-4000:]}")


def medians(runs: list[dict], warmup: int) -> dict:
    steps = [s for r in runs for s in r["steps"][warmup:]]
    out = {k: statistics.median(s[k] for s in steps) for k in ("step_s", *PHASES)}
    lengths = [x for r in runs for x in r["completion_length"][warmup:]]
    out["tokens_per_sample"] = statistics.median(lengths) if lengths else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,mid,large")
    ap.add_argument("--steps", type=int, default=5, help="training steps per run")
    ap.add_argument("--blocks", type=int, default=2, help="runs of each side, alternated")
    ap.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of every run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rldsl-only", action="store_true", help="rldsl's phases only (the regression guard)")
    ap.add_argument("--baseline", type=Path, help="compare rldsl's phases with this recorded file")
    ap.add_argument("--record", type=Path, help="write rldsl's phases here as the new baseline")
    ap.add_argument("--lengths", choices=["fixed", "lognormal"], default="fixed",
                    help="answer lengths: all N, or long-tailed (module docstring)")
    ap.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "trl":
        trl_worker(a.size, a.model, a.steps, a.out, a.seed, a.lengths)
        return
    if a.steps <= a.warmup:
        raise SystemExit("--steps must exceed --warmup")
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown size(s) {unknown}; the sizes: {', '.join(SIZES)}")
    sides: tuple[str, ...] = ("rldsl",) if a.rldsl_only else ("trl", "rldsl")
    if a.lengths == "lognormal":
        sides += ("rldsl-packed",)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    results: dict[str, dict[str, dict]] = {}
    peak = matmul_peak(sizes)
    print(f"fp32 matmul peak, one thread: {peak / 1e9:.1f} GFLOP/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="rldsl-step-phases-") as tmp:
        for size in sizes:
            model = make_model(size, Path(tmp) / f"model-{size}")
            flops = matmul_flops(size, model, a.lengths, a.seed, a.steps, a.warmup)
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            for b in range(a.blocks):
                for side in sides:
                    out = Path(tmp) / f"{size}-{side}-{b}"
                    out.mkdir()
                    if side == "trl":
                        run_child([sys.executable, str(Path(__file__).resolve()), "--worker", "trl", "--size", size,
                                   "--model", str(model), "--steps", str(a.steps), "--out", str(out),
                                   "--seed", str(a.seed), "--lengths", a.lengths], env)
                        runs[side].append(json.loads((out / "result.json").read_text()))
                    else:
                        run_child(rldsl_command(size, model, a.steps, out, a.seed, a.lengths,
                                                packing=side == "rldsl-packed"), env)
                        runs[side].append(read_rldsl(out))
            results[size] = {side: medians(r, a.warmup) for side, r in runs.items()}
            again = matmul_peak([size])  # after the size's runs too: a rate drawn low once must not flatter
            peak = max(peak, again)
            print(f"fp32 matmul peak after {size}: {again / 1e9:.1f} GFLOP/s; the floor uses the best so far, "
                  f"{peak / 1e9:.1f}", flush=True)
            print(table(size, results[size], a.lengths), flush=True)
            print(floor_line(flops, peak, results[size]), flush=True)
    conditions = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(),
                  "steps": a.steps, "blocks": a.blocks, "warmup": a.warmup, "threads": 1, "lengths": a.lengths,
                  "date": time.strftime("%Y-%m-%d"), "matmul_gflops": round(peak / 1e9, 1)}
    if a.baseline is not None:
        print(guard(results, json.loads(a.baseline.read_text())))
    if a.record is not None:
        a.record.write_text(json.dumps({"conditions": conditions,
                                        **{side: {s: r[side] for s, r in results.items()}
                                           for side in sides if side != "trl"}}, indent=1) + "\n")
        print(f"recorded {a.record}")


def table(size: str, r: dict, lengths: str = "fixed") -> str:
    hidden, layers, _, new, P, G = SIZES[size]
    ours = [side for side in r if side != "trl"]
    head = "| phase | " + " | ".join(f"{side} s" for side in ours) + (" | TRL s | " + " | ".join(
        f"{side} / TRL" for side in ours) if "trl" in r else "") + " |"
    what = f"{new} new tokens (fixed)" if lengths == "fixed" else f"answers log-normal, median {new // 8}, limit {new}"
    lines = [f"\n{size}: hidden {hidden}, {layers} layers, {what}, {P} x {G}", head,
             "|---" * (head.count("|") - 1) + "|"]
    for k in (*PHASES, "step_s", "tokens_per_sample"):
        cells = [f"{r[side][k]:.3f}" for side in ours]
        if "trl" in r:
            cells.append(f"{r['trl'][k]:.3f}")
            for side in ours:
                ok = r["trl"][k] > 0 and k != "tokens_per_sample"
                cells.append(f"{r[side][k] / r['trl'][k]:.2f}x" if ok else "-")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def floor_line(flops: dict, peak: float, r: dict) -> str:
    """The matmul floor of the step (module docstring) against both sides' step time."""
    gen, upd = flops["generate"] / peak, flops["update"] / peak
    line = (f"matmul floor: {gen + upd:.3f} s (generate {gen:.3f} s, update {upd:.3f} s; "
            f"N = {flops['N'] / 1e6:.2f}M weights, prompt {flops['Tp']:.1f} tokens); "
            f"rldsl's step is {r['rldsl']['step_s'] / (gen + upd):.2f}x the floor")
    for side in (s for s in r if s not in ("trl", "rldsl")):
        line += (f"; {side}'s step {r[side]['step_s'] / (gen + upd):.2f}x the floor, its update "
                 f"{r[side]['update'] / upd:.2f}x the update floor")
    if "trl" in r:
        line += (f"; the floor is {(gen + upd) / r['trl']['step_s']:.2f}x TRL's step"
                 + (" (above 0.5: the 0.5x target cannot be met in fp32 on one core)"
                    if (gen + upd) / r["trl"]["step_s"] > 0.5 else ""))
    return line


def guard(results: dict, baseline: dict) -> str:
    """rldsl's phases now / in the baseline, per size: > 1 is slower than recorded."""
    lines = [f"\nregression guard against the baseline of {baseline['conditions'].get('date', '?')} "
             f"({baseline['conditions'].get('machine', '?')}): now / then",
             "| size | " + " | ".join((*PHASES, "step_s")) + " |", "|---" * (len(PHASES) + 2) + "|"]
    for size, r in results.items():
        for side in (s for s in r if s != "trl"):
            then = baseline.get(side, {}).get(size)
            name = size if side == "rldsl" else f"{size} ({side})"
            if then is None:
                lines.append(f"| {name} | no baseline |")
                continue
            cells = [f"{r[side][k] / then[k]:.2f}" if then[k] > 1e-4 else "-" for k in (*PHASES, "step_s")]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
