"""Seconds per training step and tokens per second of the real runtime, per library spec.

    .venv/bin/python bench/step.py                        # lite_ppo, grpo: 3 blocks x 10 steps each
    .venv/bin/python bench/step.py --specs lite_ppo,grpo,bench/dapo_like.rl --ablate

The runtime's own code path: ``rldsl.runtime.run.build.build_run`` then ``run.step.train_step`` (rollout
with the HF engine, reward, old logprobs, the compiled loss, the update, the weight sync) on
the embedded toy model (0.59M-parameter Llama, warm start from the cache), 16 prompts x 8
samples, at most ``--max-new-tokens`` (16) new tokens, one update per rollout, 1 thread.
Every update is taken (``train.skip_zero_advantage=false``). After ``--warmup`` steps per
spec (torch.compile of the loss), blocks of ``--steps`` steps run in turn for every
spec (A, B, A, B ...), so that machine noise hits all of them; the table gives the median
over all timed steps.

    seconds per step   ``step_s`` of the step's metrics (wall clock of train_step)
    tokens per second  (prompt + response tokens of the batch) / step_s, as ``tokens_per_s``
    generate / update  the step's ``time/rollout_s`` and ``time/update_s`` medians

``--ablate`` also runs each spec with the runtime's speed paths turned off one at a time
(bench/README.md explains them): ``-sampler`` samples with ``model.generate``,
``-shared-prompt`` runs every row's prompt through the backbone, ``-skip-old`` recomputes
the old logprobs in a separate forward; ``plain`` turns all three off.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ABLATIONS = {
    "all on": set(),
    "-sampler": {"sampler"},
    "-shared-prompt": {"shared"},
    "-skip-old": {"skip_old"},
    "plain": {"sampler", "shared", "skip_old"},
}


def make_setup(spec: str, off: set[str], args, tmp: Path):
    import torch

    from rldsl.runtime.batch import model_inputs
    from rldsl.runtime.run.build import build_run
    from rldsl.runtime.config import load_config
    from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs

    cfg = load_config(None, [
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.samples}", f"threads={args.threads}", f"seed={args.seed}",
        "data.eval_size=0", "train.skip_zero_advantage=false",
    ])
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    s = build_run(spec, cfg, run_dir)
    tr = s.trainers.trainer
    if "sampler" in off:
        s.rollouts.engine._sampler_ok = False
    if "skip_old" in off:
        tr._old_is_current = lambda: False
    if "shared" in off:
        def full_logprobs(model, batch, *, grad, entropy, _tr=tr):
            ids, attn, _ = model_inputs(batch)
            with torch.set_grad_enabled(grad):
                return token_logprobs(model, Forward(ids, attn, batch.response_ids.shape[1]),
                                      LogprobOptions(entropy=entropy, entropy_grad=grad and _tr.fn.algorithm.uses_entropy,
                                                     chunk_size=_tr.logprob_chunk))
        tr._logprobs = full_logprobs
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--specs", default="lite_ppo,grpo", help="comma-separated library names or .rl files")
    ap.add_argument("--steps", type=int, default=10, help="steps per block")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per spec first (compile)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ablate", action="store_true", help="also run with each speed path turned off")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from rldsl.runtime.run import step as run_step
    from rldsl.runtime.toy import warm_start
    warm_start(verbose=True)

    specs = [x.strip() for x in args.specs.split(",") if x.strip()]
    modes = list(ABLATIONS) if args.ablate else ["all on"]
    tmp = Path(tempfile.mkdtemp(prefix="rldsl-bench-step-"))
    runs = {}
    for spec in specs:
        for mode in modes:
            s = make_setup(spec, ABLATIONS[mode], args, tmp)
            for i in range(args.warmup):
                run_step.train_step(s, i)
            runs[(spec, mode)] = {"setup": s, "next": args.warmup, "m": []}
    for _ in range(args.blocks):
        for key, r in runs.items():
            for _ in range(args.steps):
                r["m"].append(run_step.train_step(r["setup"], r["next"]))
                r["next"] += 1

    def med(r, k):
        return statistics.median(m[k] for m in r["m"])

    print(f"\n{args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} new tokens, "
          f"{args.threads} thread(s); median of {args.blocks} x {args.steps} steps per row "
          f"(after {args.warmup} warm-up steps), blocks interleaved")
    print("| spec | speed paths | s/step | tokens/s | generate s | logprobs s | update s | response tokens |")
    print("|---|---|---|---|---|---|---|---|")
    out = []
    for (spec, mode), r in runs.items():
        row = {"spec": spec, "mode": mode, "step_s": med(r, "step_s"), "tokens_per_s": med(r, "tokens_per_s"),
               "rollout_s": med(r, "time/rollout_s"), "logprobs_s": med(r, "time/logprobs_s"),
               "update_s": med(r, "time/update_s"),
               "response_length": statistics.mean(m["response_length"] for m in r["m"])}
        out.append(row)
        print(f"| {Path(spec).stem} | {mode} | {row['step_s']:.4f} | {row['tokens_per_s']:.0f} | "
              f"{row['rollout_s']:.4f} | {row['logprobs_s']:.4f} | {row['update_s']:.4f} | "
              f"{row['response_length']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": out}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
