"""What reading the policy's top-K (or its self-certainty) costs a training step: memory and time, side by side.

    nice -n 10 .venv/bin/python bench/topk.py                  # B x Tr x V = 16 x 256 x 32000, K = 3
    nice -n 10 .venv/bin/python bench/topk.py --tr 64 --repeats 2   # quicker
    nice -n 10 .venv/bin/python bench/topk.py --what self_certainty  # Intuitor's input instead

Two specs that differ only in whether they read the top-K: ``algorithms/examples/simko.rl``
(reads ``topk_logp``, ``old_topk_logp`` and ``is_top1``), and the same spec with its top-K term
replaced by the sampled token's ratio (``topk_sum = K * ratio``) and ``is_top1`` by 1 -- the same
loss arithmetic otherwise. One step = ``Trainer.estimate`` + ``Trainer.update`` on a fixed
rollout of random tokens (a Llama of hidden 128, 2 layers, vocabulary V, fp32), in two regimes:

    on-policy   ppo_epochs 1, one minibatch: no old forward runs; the update forward picks the
                top-K of each position itself (a ``torch.topk`` per LM-head chunk)
    off-policy  ppo_epochs 2, two minibatches: the old forward picks and keeps the K ids
                [B, Tr, K] and logprobs; the update forwards gather the current logprobs there

Memory: each (spec, regime) runs in its own subprocess; the figure is the process's peak RSS
(``ru_maxrss``) minus its RSS right before the first step (model, optimizer state and rollout
already allocated) -- the extra memory the step needed at its peak -- and, allocator-independent,
the peak of the live bytes of tensor storage created inside the step (a ``TorchDispatchMode``
adding each new storage and dropping it when it is freed), in an untimed step after the timed
ones. Time: the median of ``--repeats`` steps after a warm-up step, ``--threads`` torch threads;
the subprocesses alternate (top-K / plain, ``--rounds`` times) and the ratio is of the medians of
the rounds' medians, so machine load hits both sides alike. Prints each figure and the ratios
top-K / plain (1.00 = no cost).

``--what self_certainty``: the same measurement for ``algorithms/examples/intuitor.rl`` (reads
``self_certainty``: one more reduction of each LM-head chunk of the old forward) against two
twins: ``old_logp``, its shaping reading ``old_logp`` instead (``r = seq_sum(old_logp) / L``: the
same forwards -- an advantage formula reading the old policy runs the old forward in both regimes
-- without the self-certainty), the cost of the reduction itself; and ``none``, its shaping
removed (GRPO on the reward: on-policy no old forward runs), the cost of the input with the old
forward it brings. Ratios self_certainty / each twin.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIMKO = ROOT / "algorithms" / "examples" / "simko.rl"
INTUITOR = ROOT / "algorithms" / "examples" / "intuitor.rl"
#: the variants of each measurement, the one that reads the input first
VARIANTS = {"topk": ("topk", "plain"), "self_certainty": ("self_certainty", "old_logp", "none")}


def plain_spec() -> str:
    """SimKO without the top-K: the top-K sum replaced by K times the sampled token's ratio (what
    it is when the K candidates' ratios equal the sampled one's), is_top1 by 1."""
    text = SIMKO.read_text()
    text = text.replace("    rk = exp(topk_logp - old_topk_logp)\n", "")
    text = text.replace("topk_sum = k_sum(sg(ratio) / (sg(rk) + 1e-8) * rk)", "topk_sum = K * ratio")
    text = text.replace("where(seq_sum(A) < 0, is_top1, 0)", "where(seq_sum(A) < 0, 1, 0)")
    return text.replace("algorithm simko ", "algorithm simko_plain ")


def intuitor_spec(variant: str) -> str:
    """Intuitor's spec (``self_certainty``), or a twin whose shaping reads the old logprobs instead
    (``old_logp``) or is removed (``none``)."""
    text = INTUITOR.read_text()
    if variant == "self_certainty":
        return text
    body = ("    c = batch_mean(self_certainty)\n"
            "    r = seq_sum(self_certainty - c) / (L + 1e-8)\n")
    assert body in text
    if variant == "old_logp":
        return text.replace(body, "    r = seq_sum(old_logp) / (L + 1e-8)\n").replace(
            "algorithm intuitor ", "algorithm intuitor_old_logp ")
    define = "  define self_certainty_reward\n" + body + "  end\n"
    assert define in text
    return text.replace(define, "").replace("  shaping       self_certainty_reward\n", "").replace(
        "algorithm intuitor ", "algorithm intuitor_none ")


def spec_text(variant: str) -> str:
    """The spec a variant runs."""
    if variant == "topk":
        return SIMKO.read_text()
    return plain_spec() if variant == "plain" else intuitor_spec(variant)


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _LiveBytes:
    """Live bytes of tensor storage created inside (and their peak), whatever the allocator keeps."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.live = 0
        self.peak = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        tracker.add(t.untyped_storage())
                return out

        self.mode = Mode()
        self.seen: set[int] = set()

    def add(self, storage) -> None:  # noqa: ANN001
        key = storage.data_ptr()
        if key in self.seen or storage.nbytes() == 0:
            return
        self.seen.add(key)
        n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        self.seen.discard(key)
        self.live -= n


def child(args: argparse.Namespace) -> None:
    """One (spec, regime): build, warm up, time, measure; print one JSON line."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import rldsl
    from rldsl.runtime.batch import RolloutBatch
    from rldsl.runtime.config import RunConfig
    from rldsl.runtime.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.tp + args.tr + 8)
    model = LlamaForCausalLM(cfg)
    B, G = args.rows, 4
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab, (B // G, args.tp), generator=g).repeat_interleave(G, 0)
    resp = torch.randint(0, args.vocab, (B, args.tr), generator=g)
    lengths = torch.randint(args.tr // 4, args.tr + 1, (B,), generator=g)
    rmask = (torch.arange(args.tr)[None] < lengths[:, None]).long()
    batch = RolloutBatch(prompt, torch.ones_like(prompt), resp * rmask, rmask, torch.zeros(B, args.tr),
                         ["stop"] * B, [""] * B, [""] * B, G)
    rewards = (torch.arange(B) % 3 == 0).float()
    text = spec_text(args.variant)
    spec = rldsl.loads(text, filename=f"{args.variant}.rl")
    fn = rldsl.compile(spec, compile=False)
    run = RunConfig()
    run.train.ppo_epochs, run.train.minibatches = (1, 1) if args.regime == "on-policy" else (2, 2)
    run.train.skip_zero_advantage = False
    trainer = Trainer.from_config(run, fn, model)
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        trainer.update(trainer.estimate(batch, rewards), torch.Generator().manual_seed(0))

    base = _rss_now()
    step()  # warm-up
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = _peak_rss() - base
    live = _LiveBytes()
    with live.mode:
        step()
    print(json.dumps({"variant": args.variant, "regime": args.regime, "s": statistics.median(times),
                      "peak_rss_mb": peak / 2**20, "peak_live_mb": live.peak / 2**20}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tp", type=int, default=32)
    p.add_argument("--tr", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--regimes", default="on-policy,off-policy", help="comma-separated: on-policy, off-policy")
    p.add_argument("--what", choices=list(VARIANTS), default="topk",
                   help="the input measured: the policy's top-K (SimKO) or the self-certainty (Intuitor)")
    p.add_argument("--variant", choices=[v for vs in VARIANTS.values() for v in vs], help=argparse.SUPPRESS)
    p.add_argument("--regime", choices=["on-policy", "off-policy"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        child(args)
        return
    variants = VARIANTS[args.what]
    print(f"B x Tr x V = {args.rows} x {args.tr} x {args.vocab}, " + ("K = 3, " if args.what == "topk" else "")
          + f"{args.threads} thread(s); load {os.getloadavg()[0]:.1f}")
    for regime in args.regimes.split(","):
        got: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                cmd = [sys.executable, __file__, "--variant", variant, "--regime", regime] + \
                      [f"--{k}={v}" for k, v in vars(args).items() if k not in ("variant", "regime", "regimes")]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                got[variant].append(json.loads(out.strip().splitlines()[-1]))
        row = {v: {k: statistics.median(r[k] for r in rs) for k in ("s", "peak_rss_mb", "peak_live_mb")}
               for v, rs in got.items()}
        t = row[variants[0]]
        for other in variants[1:]:
            b = row[other]
            label = regime if args.what == "topk" else f"{regime} vs {other}"
            print(f"{label:10s}  s/step {t['s']:.3f} vs {b['s']:.3f} ({t['s'] / b['s']:.2f}x)   "
                  f"peak RSS +{t['peak_rss_mb']:.0f} vs +{b['peak_rss_mb']:.0f} MB "
                  f"({t['peak_rss_mb'] / b['peak_rss_mb']:.2f}x)   peak live tensors {t['peak_live_mb']:.0f} vs "
                  f"{b['peak_live_mb']:.0f} MB ({t['peak_live_mb'] / b['peak_live_mb']:.2f}x)")


if __name__ == "__main__":
    main()
