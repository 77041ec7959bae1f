"""Packed vs padded training forwards at long-tailed answer lengths: one forward + backward of
``token_logprobs`` (what the update runs per micro-batch), and the no-grad forward (old/ref
logprobs), on one thread.

    .venv/bin/python bench/packing.py                      # mid and large, 64 rows
    .venv/bin/python bench/packing.py --sizes mid --repeats 3
    .venv/bin/python bench/packing.py --sizes tiny,mid,large --compile   # also model.compile
    python bench/packing.py --device cuda --dtype bfloat16 --sizes mid,large,xl   # on a GPU

The model: bench/step_phases.py's random-init Llama of that size (toy tokenizer). The rows:
P = 8 prompts of the addition task x G = 8 samples, answers drawn as in
``step_phases.py --lengths lognormal`` (bench/forced_lengths.py: log-normal, median N / 8,
between 2 and the limit N). Padded = the trainer's default path (the shared-prompt forward
when it applies); packed = ``train.packing`` with rows of at most the longest sequence.
The rows of a group share their prompt, so packed takes shared-prompt rows (each prompt once
per packed row); ``plain`` is the packed path with every sample's prompt in its own sequence,
what packing computed before shared-prompt rows. Reports the median seconds of ``--repeats``
runs after one warm-up, the tokens each path computed, and the largest difference of their
logprobs. ``--compile`` adds the packed path
through a ``torch.compile``d body (what ``model.compile = true`` runs: dynamic shapes), its
compile time (the first calls, with and without grad) and its largest logprob difference from
eager.

On a GPU (``--device cuda``): every thread the host has, the clock read after
``torch.cuda.synchronize()``, ``--dtype bfloat16`` runs under autocast with float32 weights
(what ``model.dtype = "bfloat16"`` trains with), and the size ``xl`` (Qwen2-0.5B's width and
depth: hidden 896, 24 layers, 14 heads, answers up to 1024 tokens, 4 prompts x 8 samples; the
toy vocabulary) is worth timing there. The report adds the peak GPU memory of each path.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from forced_lengths import lengths as drawn  # noqa: E402
from step_phases import SIZES, make_model  # noqa: E402

XL = (896, 24, 14, 1024, 4, 8)  # hidden, layers, heads, new tokens, prompts, samples: GPU-sized


def rows(tokenizer, limit: int, seed: int = 0, P: int = 8, G: int = 8):
    from rldsl.runtime.toy import AdditionTask
    prompts = [e.prompt for e in AdditionTask().prompt_source(seed).next_batch(P)]
    enc = tokenizer([p for p in prompts for _ in range(G)], return_tensors="pt", padding=True)
    L = torch.tensor(drawn(seed, 0, P * G, limit))
    Tr = int(L.max())
    g = torch.Generator().manual_seed(seed)
    resp = torch.randint(4, len(tokenizer), (P * G, Tr), generator=g)
    mask = (torch.arange(Tr)[None] < L[:, None]).long()
    ids = torch.cat([enc["input_ids"], resp.masked_fill(mask == 0, tokenizer.pad_token_id)], 1)
    return ids, torch.cat([enc["attention_mask"], mask], 1), Tr, mask.bool(), G


def timed(fn, repeats: int, sync=lambda: None) -> float:
    fn()
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="mid,large")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also the packed path with model.compile")
    ap.add_argument("--device", default="cpu", help="cpu (one thread) or cuda")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="bfloat16: autocast over float32 weights")
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    amp = dict(device_type=dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bfloat16")
    if cuda:
        print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, dtype {a.dtype}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rldsl.runtime.models.loading import backbone
    from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs
    from rldsl.runtime.train.throughput import TokenCount
    extra = " compiled s | compiled / padded | compile s | compiled logprob diff |" if a.compile else ""
    extra += " peak GiB (padded / plain / packed) |" if cuda else ""
    print("| size | answers (mean / max) | pass | padded s | plain packed s | packed s | packed / padded | "
          "packed / plain | tokens computed (padded / plain / packed) | max logprob diff |" + extra)
    print("|---" * (10 + 4 * a.compile + cuda) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes.split(","):
            dims = XL if size == "xl" else SIZES[size]
            folder = make_model(size, Path(tmp) / size, dims)
            model = AutoModelForCausalLM.from_pretrained(folder).to(dev)
            tok = AutoTokenizer.from_pretrained(folder)
            P, G = (dims[4], dims[5]) if size == "xl" else (8, 8)  # 8 x 8 at every CPU size (docstring)
            ids, mask, Tr, m, G = (t.to(dev) if isinstance(t, torch.Tensor) else t
                                   for t in rows(tok, dims[3], P=P, G=G))
            counts = {}
            body = torch.compile(backbone(model), dynamic=True) if a.compile else None

            def run(packing: bool, grad: bool, compiled: bool = False, plain: bool = False):
                key = "plain" if plain else packing
                counts[key] = TokenCount()
                with torch.set_grad_enabled(grad), plain_rows(plain), torch.autocast(**amp):
                    out = token_logprobs(model, Forward(ids, mask, Tr, group_size=G),
                                         LogprobOptions(packing=packing, count=counts[key], body=body if compiled else None))
                    lp, ent = out.logprobs, out.entropy
                    if grad:
                        ((lp * m).sum() + (ent * m).sum()).backward()
                        model.zero_grad(set_to_none=True)
                return lp.detach()

            diff = float((run(True, False) - run(False, False))[m].abs().max())
            diff = max(diff, float((run(True, False, plain=True) - run(False, False))[m].abs().max()))
            compile_s = {}
            if a.compile:
                for grad in (True, False):  # the first calls compile (a graph with and without grad)
                    t0 = time.perf_counter()
                    run(True, grad, compiled=True)
                    compile_s[grad] = time.perf_counter() - t0
                cdiff = float((run(True, False, compiled=True) - run(True, False))[m].abs().max())
            lengths = m.sum(1).float()
            for grad, name in ((True, "forward + backward"), (False, "forward (no grad)")):
                peak = []

                def measured(fn):
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(dev)
                    s = timed(fn, a.repeats, sync)
                    if cuda:
                        peak.append(torch.cuda.max_memory_allocated(dev) / 2**30)
                    return s
                padded = measured(lambda: run(False, grad))
                plain = measured(lambda: run(True, grad, plain=True))
                packed = measured(lambda: run(True, grad))
                cells = ""
                if a.compile:
                    compiled = timed(lambda: run(True, grad, compiled=True), a.repeats, sync)
                    cells = f" {compiled:.3f} | {compiled / padded:.2f}x | {compile_s[grad]:.1f} | {cdiff:.1e} |"
                if cuda:
                    cells += " " + " / ".join(f"{g:.2f}" for g in peak) + " |"
                print(f"| {size} | {lengths.mean():.1f} / {int(lengths.max())} | {name} | {padded:.3f} | {plain:.3f} | "
                      f"{packed:.3f} | {packed / padded:.2f}x | {packed / plain:.2f}x | {counts[False].computed} / "
                      f"{counts['plain'].computed} / {counts[True].computed} | {diff:.1e} |" + cells, flush=True)


@contextlib.contextmanager
def plain_rows(on: bool):
    """Packed forwards without shared-prompt rows while ``on`` (the layout before them)."""
    from rldsl.runtime.train import packing
    if not on:
        yield
        return
    saved = packing.shared_packing_supported
    packing.shared_packing_supported = lambda body: False
    try:
        yield
    finally:
        packing.shared_packing_supported = saved


if __name__ == "__main__":
    main()
