"""Does ``torch.compile`` pay in the sampler? HFEngine's KV-cached sampling loop with the
policy's transformer body eager vs compiled (``dynamic=True``, as ``model.compile`` compiles
the trainer's forwards), at bench/step_phases.py's sizes, on one thread.

    .venv/bin/python bench/sampler_compile.py                    # tiny, mid, large
    .venv/bin/python bench/sampler_compile.py --sizes mid --max-new-tokens 64

The model: step_phases.py's random-init Llama of that size (toy tokenizer); P prompts of the
addition task x G samples, temperature 1, the size's answer length (or --max-new-tokens).
Reports the median seconds of --repeats generations each after one warm-up (the compiled
side's first call is its compilation, reported apart), the graphs compiled, and whether the
compiled side drew the same tokens (same seed) and how far its logprobs are from eager's.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from packing import timed  # noqa: E402  (one warm-up call, then the median of the repeats)
from step_phases import SIZES, make_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,mid,large")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the size's answer length")
    a = ap.parse_args()
    torch.set_num_threads(1)
    import torch._dynamo as dynamo
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.rollout.engines.hf import HFEngine
    from rldsl.runtime.toy import AdditionTask
    print("| size | rows x new tokens | tokens sampled | eager s | compiled s | compiled / eager | compile s "
          "| graphs | same tokens | max logprob diff |")
    print("|---" * 10 + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes.split(","):
            folder = make_model(size, Path(tmp) / size)
            model = AutoModelForCausalLM.from_pretrained(folder)
            tok = AutoTokenizer.from_pretrained(folder)
            _, _, _, new, P, G = SIZES[size]
            new = a.max_new_tokens or new
            prompts = [e.prompt for e in AdditionTask().prompt_source(0).next_batch(P)]
            params = SamplingParams(n=G, temperature=1.0, top_p=1.0, max_new_tokens=new, seed=1)
            engine = HFEngine(model, tok)
            eager_batch = engine.generate(prompts, params)  # warm-up
            eager = timed(lambda: engine.generate(prompts, params), a.repeats)
            dynamo.reset()
            dynamo.utils.counters.clear()
            eager_forward = model.model.forward
            model.model.forward = torch.compile(eager_forward, dynamic=True)
            try:
                t0 = time.perf_counter()
                compiled_batch = engine.generate(prompts, params)  # compiles
                compile_s = time.perf_counter() - t0
                compiled = timed(lambda: engine.generate(prompts, params), a.repeats)
            finally:
                model.model.forward = eager_forward
            graphs = dynamo.utils.counters["stats"]["unique_graphs"]
            same = torch.equal(eager_batch.response_ids, compiled_batch.response_ids)
            diff = float((eager_batch.logprobs - compiled_batch.logprobs).abs().max()) if same else float("nan")
            print(f"| {size} | {P * G} x {new} | {int(eager_batch.response_mask.sum())} | {eager:.3f} | "
                  f"{compiled:.3f} | {compiled / eager:.2f}x | {compile_s:.0f} | {graphs} | {same} | {diff:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main()
