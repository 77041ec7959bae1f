"""Memory and time of one training update on a mid-size model: whole minibatch vs token
budgets, gradient checkpointing, and 1x vs 4x the batch under one budget.

A randomly initialised Qwen2-architecture model (default ~26M parameters, 32k vocabulary),
P prompts x G samples with responses of random length in [--min-response, --max-response]
tokens (synthetic rollouts: this measures the trainer, not sampling). Every configuration
runs in a fresh subprocess (``--one``), so its peak RSS (``ru_maxrss``) is its own:

    base   = RSS after the model, the trainer and AdamW's state exist (one tiny warm-up step)
    peak   = peak RSS over the timed steps
    activation part = peak - base

Run:  .venv/bin/python bench/memory.py [--steps 2] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

def configs(large: int, small: int) -> list[tuple[str, int, int | None, bool]]:
    """(label, batch multiplier, token budget, gradient checkpointing) of every run."""
    return [
        ("whole minibatch", 1, None, False),
        ("whole minibatch + grad ckpt", 1, None, True),
        (f"budget {large}", 1, large, False),
        (f"budget {small}", 1, small, False),
        (f"budget {small} + grad ckpt", 1, small, True),
        (f"budget {small}, 4x batch", 4, small, False),
    ]


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one(args: argparse.Namespace, mult: int, budget: int | None, ckpt: bool) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import rldsl
    from rldsl.runtime.batch import RolloutBatch
    from rldsl.runtime.models import enable_gradient_checkpointing
    from rldsl.runtime.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
                      intermediate_size=4 * args.hidden, tie_word_embeddings=True,
                      max_position_embeddings=4096)
    model = Qwen2ForCausalLM(cfg)
    if ckpt:
        enable_gradient_checkpointing(model)
    n_params = sum(p.numel() for p in model.parameters())
    fn = rldsl.compile(rldsl.load("lite_ppo"), compile=False)  # token_mean, no reference copy
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    trainer = Trainer(fn, model, optimizer=opt, skip_zero_advantage=False,
                      max_tokens_per_microbatch=budget)

    def batch(P: int, G: int, lo: int, hi: int, seed: int) -> RolloutBatch:
        g = torch.Generator().manual_seed(seed)
        B, Tp = P * G, args.prompt
        lengths = torch.randint(lo, hi + 1, (B,), generator=g)
        Tr = int(lengths.max())
        prompt = torch.randint(3, 32000, (P, Tp), generator=g).repeat_interleave(G, 0)
        resp = torch.randint(3, 32000, (B, Tr), generator=g)
        mask = (torch.arange(Tr) < lengths[:, None]).long()
        return RolloutBatch(prompt, torch.ones(B, Tp, dtype=torch.long), resp * mask, mask,
                            torch.zeros(B, Tr), ["length"] * B, [""] * B, [""] * B, G)

    rewards_of = lambda b: torch.randn(len(b), generator=torch.Generator().manual_seed(1))
    warm = batch(1, 2, 4, 4, 0)
    trainer.update(trainer.estimate(warm, rewards_of(warm)))  # AdamW state exists from here
    base = rss_mib()
    b = batch(args.prompts * mult, args.samples, args.min_response, args.max_response, 2)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        trainer.update(trainer.estimate(b, rewards_of(b)))
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = int(b.prompt_mask.sum() + b.response_mask.sum())
    return {"params_m": n_params / 1e6, "rows": len(b), "tokens": tokens, "base_mib": base,
            "peak_mib": peak, "activation_mib": peak - base, "s_per_step": min(times),
            "s_per_1k_tokens": min(times) / tokens * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--min-response", type=int, default=256)
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per configuration (min taken)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budgets", default="8192,4096", help="the two token budgets (large,small)")
    ap.add_argument("--only", default="", help="comma-separated labels to run (default all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        mult, budget, ckpt = json.loads(args.one)
        print(json.dumps(one(args, mult, budget, ckpt)))
        return
    rows = []
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--json") and a != args.json]
    large, small = (int(x) for x in args.budgets.split(","))
    for label, mult, budget, ckpt in configs(large, small):
        if args.only and label not in args.only.split(","):
            continue
        out = subprocess.run([sys.executable, __file__, *passthrough, "--one", json.dumps([mult, budget, ckpt])],
                             capture_output=True, text=True, check=True)
        r = {"config": label, **json.loads(out.stdout.strip().splitlines()[-1])}
        rows.append(r)
        print(f"{label:30s} rows {r['rows']:4d} tokens {r['tokens']:6d}  base {r['base_mib']:7.0f} MiB  "
              f"peak {r['peak_mib']:7.0f} MiB  activations {r['activation_mib']:7.0f} MiB  "
              f"{r['s_per_step']:7.2f} s/step  {r['s_per_1k_tokens']:.3f} s/1k tokens", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
