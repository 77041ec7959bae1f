"""Where the update's time goes against its real-token matmul floor, measured in one run: the
floor, the update's own matrix products alone (the model's shapes, run as bare ``torch.mm``
calls), the packed forward + backward, and the optimizer step, on one thread.

    .venv/bin/python bench/gemm_floor.py                    # mid and large
    .venv/bin/python bench/gemm_floor.py --sizes mid --repeats 7

The batch: bench/packing.py's (8 prompts x 8 answers of the addition task, answers log-normal
with median N / 8 between 2 and N, the size's N).
The floor is bench/step_phases.py's: 6 N flops per trained token (N the linear weights, LM
head included, embeddings out), each group's prompt counted once, divided by the best fp32
matmul rate of one thread here (a 2048^3 square and the size's own shapes, 8192 rows).

The products alone: for every linear layer (q, k, v, o, gate, up, down per layer, the LM head
once) of weight [in, out], the forward [M, in] x [in, out] and the two backward products
(input gradient [M, out] x [out, in], weight gradient [in, M] x [M, out]) on random data, with M
the real tokens (what the floor counts) and with M the tokens the packed rows compute (filler
and each row's prompt copies included). What is left between the products and the measured
forward + backward is the rest of the work: normalization, rotary, activations and their
backward, attention, the head's log-softmax, the layout. Their ratios to the floor say which
part keeps the update above 1.3x of it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from packing import rows  # noqa: E402
from step_phases import SIZES, make_model, matmul_peak  # noqa: E402


def median_s(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def linear_shapes(model) -> list[tuple[int, int]]:
    """(in, out) of every linear weight the update multiplies by (embeddings excluded)."""
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def products(shapes: list[tuple[int, int]], M: int):
    """A function running the forward and both backward products of every weight for M tokens."""
    g = torch.Generator().manual_seed(0)
    ops = []
    for k, n in shapes:
        x, w, dy = (torch.randn(a, b, generator=g) for a, b in ((M, k), (k, n), (M, n)))
        ops += [(x, w), (dy, w.t().contiguous()), (x.t().contiguous(), dy)]

    def run() -> None:
        for a, b in ops:
            torch.mm(a, b)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="mid,large")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rldsl.runtime.train.logprobs import token_logprobs
    from rldsl.runtime.train.throughput import TokenCount
    print("| size | real tokens (floor) | computed tokens | rate GFLOP/s | floor s | products at real tokens | "
          "products at computed tokens | forward + backward | rest (fwd + bwd - products) | optimizer step |")
    print("|---" * 10 + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes.split(","):
            limit = SIZES[size][3]
            model = AutoModelForCausalLM.from_pretrained(make_model(size, Path(tmp) / size))
            tok = AutoTokenizer.from_pretrained(Path(tmp) / size)
            ids, mask, Tr, m, G = rows(tok, limit)
            shapes = linear_shapes(model)
            N = sum(k * n for k, n in shapes)
            prompt = int(mask[:, :-Tr].sum()) // G  # each group's prompt once: P x Tp
            real = prompt + int(m.sum())

            def step(count: TokenCount | None = None) -> None:
                model.zero_grad(set_to_none=True)  # as each update step starts
                lp, ent = token_logprobs(model, ids, mask, Tr, group_size=G, packing=True, count=count)
                ((lp * m).sum() + (ent * m).sum()).backward()

            count = TokenCount()
            step(count)
            computed = count.computed
            fwd_bwd = median_s(step, a.repeats)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            opt_s = median_s(opt.step, a.repeats)  # on the last step's gradients
            rate = matmul_peak([size])
            floor = 6 * N * real / rate
            at_real = median_s(products(shapes, real), a.repeats)
            at_computed = median_s(products(shapes, computed), a.repeats)
            print(f"| {size} | {real} | {computed} | {rate / 1e9:.1f} | {floor:.3f} | {at_real:.3f} ({at_real / floor:.2f}x) | "
                  f"{at_computed:.3f} ({at_computed / floor:.2f}x) | {fwd_bwd:.3f} ({fwd_bwd / floor:.2f}x) | "
                  f"{fwd_bwd - at_computed:.3f} ({(fwd_bwd - at_computed) / floor:.2f}x) | "
                  f"{opt_s:.3f} ({opt_s / floor:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
