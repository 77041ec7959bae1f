"""Where the update's time goes against its real-token matmul floor, measured in one run: the
floor, the update's own matrix products alone (the model's shapes, run as bare ``torch.mm``
calls), the packed forward + backward, and the optimizer step, on one thread.

    .venv/bin/python bench/gemm_floor.py                    # mid and large
    .venv/bin/python bench/gemm_floor.py --sizes mid --repeats 7

The batch: bench/packing.py's (8 prompts x 8 answers of the addition task, answers log-normal
with median N / 8 between 2 and N, the size's N).
The floor is bench/step_phases.py's: 6 N flops per trained token (N the linear weights, LM
head included, embeddings out), each group's prompt counted once, divided by the best fp32
matmul rate of one thread here (a 2048^3 square and the size's own shapes, 8192 rows; measured
at the start and again after each size, the best so far used, as step_phases.py does).

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

from packing import rows, timed  # noqa: E402
from step_phases import BETAS, CLIP, EPS, LR, SIZES, SPEC, make_model, matmul_peak  # noqa: E402


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


def trainer_update(folder: Path, out: Path, ids, mask, Tr: int, G: int, repeats: int) -> float:
    """Median seconds of the runtime's own ``Trainer.update`` on this batch (bench/dapo_like.rl,
    step_phases.py's training settings, packing on; random 0/1 rewards): the loss, the
    optimizer step and the bookkeeping on top of the forward + backward."""
    from rldsl.runtime.batch import RolloutBatch
    from rldsl.runtime.config import load_config
    from rldsl.runtime.run.build import build
    from rldsl.runtime.run.folder import open_run
    sets = {"model.path": folder, "rollout.prompts_per_step": ids.shape[0] // G, "rollout.n": G,
            "reward.name": "math", "train.lr": LR, "train.betas": f"{BETAS[0]},{BETAS[1]}", "train.eps": EPS,
            "train.weight_decay": 0.0, "train.grad_clip": CLIP, "train.ppo_epochs": 1, "train.minibatches": 1,
            "train.lr_schedule": "constant", "train.skip_zero_advantage": "false", "threads": 1,
            "data.eval_size": 0, "eval.every": 0, "checkpoint.every": 0, "log.progress": "false",
            "train.packing": "true", "out": out}
    opened = open_run(str(SPEC), load_config(None, [f"{k}={v}" for k, v in sets.items()]))
    trainers = build(opened.plan, opened.run_dir).trainers
    B, Tp = ids.shape[0], ids.shape[1] - Tr
    resp = mask[:, Tp:]
    batch = RolloutBatch(prompt_ids=ids[:, :Tp], prompt_mask=mask[:, :Tp], response_ids=ids[:, Tp:],
                         response_mask=resp, logprobs=-0.5 * resp.float(), finish_reason=["stop"] * B,
                         prompts=[""] * B, completions=[""] * B, group_size=G, answers=[""] * B)
    rewards = (torch.rand(B, generator=torch.Generator().manual_seed(0)) > 0.5).float()
    out_s = []
    for i in range(repeats + 1):  # the first: warm-up (the compiled loss)
        estimated = trainers.estimate(batch, rewards)
        t0 = time.perf_counter()
        trainers.update(estimated, i)
        out_s.append(time.perf_counter() - t0)
    return statistics.median(out_s[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="mid,large")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs
    from rldsl.runtime.train.throughput import TokenCount
    print("| size | real tokens (floor) | computed tokens | rate GFLOP/s | floor s | products at real tokens | "
          "products at computed tokens | forward + backward | rest (fwd + bwd - products) | optimizer step | "
          "Trainer.update |")
    print("|---" * 11 + "|")
    best = matmul_peak(a.sizes.split(","))  # at the start; the best so far is used
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
                out = token_logprobs(model, Forward(ids, mask, Tr, group_size=G),
                                     LogprobOptions(packing=True, count=count))
                lp, ent = out.logprobs, out.entropy
                ((lp * m).sum() + (ent * m).sum()).backward()

            count = TokenCount()
            step(count)
            computed = count.computed
            fwd_bwd = timed(step, a.repeats)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            opt_s = timed(opt.step, a.repeats)  # on the last step's gradients
            update = trainer_update(Path(tmp) / size, Path(tmp) / f"{size}-run", ids, mask, Tr, G, a.repeats)
            best = rate = max(best, matmul_peak([size]))  # again after the size: a rate drawn low once must not flatter
            floor = 6 * N * real / rate
            at_real = timed(products(shapes, real), a.repeats)
            at_computed = timed(products(shapes, computed), a.repeats)
            print(f"| {size} | {real} | {computed} | {rate / 1e9:.1f} | {floor:.3f} | {at_real:.3f} ({at_real / floor:.2f}x) | "
                  f"{at_computed:.3f} ({at_computed / floor:.2f}x) | {fwd_bwd:.3f} ({fwd_bwd / floor:.2f}x) | "
                  f"{fwd_bwd - at_computed:.3f} ({(fwd_bwd - at_computed) / floor:.2f}x) | "
                  f"{opt_s:.3f} ({opt_s / floor:.2f}x) | {update:.3f} ({update / floor:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
