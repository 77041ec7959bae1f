"""Generalized JSD of a student from a teacher over the full vocabulary, forward + backward:
chunked (runtime/train/divergence.py) vs the naive full logits of both models.

    .venv/bin/python bench/distill_jsd.py                        # N x V = 4096 x 32000, H 256
    .venv/bin/python bench/distill_jsd.py --N 1024 --repeats 2   # smaller / quicker

Both variants start from the same student hidden states [N, H] (a parameter), the student's
LM head [V, H] (a parameter), the teacher's hidden states and head (no gradient), and compute
the per-token divergence (beta 0.5, temperature 1) then backpropagate its mean to the student:

    naive    z_S = h_S W_S^T, z_T = h_T W_T^T  ([N, V] each), generalized_jsd(z_S, z_T)
    chunked  chunked_generalized_jsd(...): C = --chunk tokens at a time under checkpointing,
             so at most one chunk's [C, V] logits of each model exist, forward and backward

Memory as bench/logprobs.py measures it (each variant in its own subprocess): peak RSS minus
the RSS right before the first forward, and the peak bytes of live torch storages created by
the computation (allocator-independent). Time: median of --repeats after one warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logprobs import ROOT, _live_bytes_tracker, _peak_rss, _rss_now  # noqa: E402


def worker(variant: str, N: int, V: int, H: int, repeats: int, threads: int, chunk: int, beta: float) -> dict:
    import torch
    from rldsl.components.distill import generalized_jsd
    from rldsl.runtime.train.divergence import chunked_generalized_jsd
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(N, H, generator=g).requires_grad_()
    ws = (torch.randn(V, H, generator=g) * 0.05).requires_grad_()
    ht, wt = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.05

    def run():
        hs.grad = ws.grad = None
        if variant == "naive":
            d = generalized_jsd(hs @ ws.T, ht @ wt.T, beta)
        else:
            d = chunked_generalized_jsd(hs, ws, None, ht, wt, None, beta, chunk=chunk)
        loss = d.mean()
        loss.backward()
        return [float(loss), float(hs.grad.sum()), float(ws.grad.abs().sum())]

    rss0 = _rss_now()
    checksum = run()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    peak_rss_extra = _peak_rss() - rss0
    with _live_bytes_tracker() as tracker:
        run()
    return {"median_s": statistics.median(times), "peak_rss_extra": peak_rss_extra,
            "peak_tensor_bytes": tracker.peak, "checksum": checksum}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--N", type=int, default=4096, help="tokens")
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--H", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.N, a.V, a.H, a.repeats, a.threads, a.chunk, a.beta)))
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    res = {}
    for variant in ("chunked", "naive"):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant]
        for k in ("N", "V", "H", "chunk", "beta", "repeats", "threads"):
            cmd += [f"--{k}", str(getattr(a, k))]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(ROOT))
        if out.returncode:
            raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
        res[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    c, n = res["chunked"], res["naive"]
    same = all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for x, y in zip(c["checksum"], n["checksum"]))
    mib = 2 ** 20
    print(f"N x V = {a.N} x {a.V}, H = {a.H}, beta {a.beta}, fp32, forward + backward, {a.threads} thread(s), "
          f"median of {a.repeats} (after 1 warm-up)")
    print("| | seconds | peak extra RSS | peak live tensor bytes |")
    print("|---|---|---|---|")
    for name, r in (("naive (full logits of both)", n), (f"chunked (chunk {a.chunk})", c)):
        print(f"| {name} | {r['median_s']:.2f} | {r['peak_rss_extra'] / mib:.0f} MiB | "
              f"{r['peak_tensor_bytes'] / mib:.0f} MiB |")
    print(f"| chunked / naive | {c['median_s'] / n['median_s']:.2f}x | "
          f"{c['peak_rss_extra'] / n['peak_rss_extra']:.3f}x | {c['peak_tensor_bytes'] / n['peak_tensor_bytes']:.3f}x |")
    print(f"same loss and gradients (sums to 1e-4 relative): {same}")


if __name__ == "__main__":
    main()
