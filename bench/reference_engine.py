"""Where a vLLM run's reference model (a spec reading ``ref_reward``) should sample: the HF engine
in the run's process, or a second vLLM engine beside the policy's. Runs in the vLLM venv:

    .venv-vllm/bin/python bench/reference_engine.py            # docs/formulas.md's figures
    .venv-vllm/bin/python bench/reference_engine.py --rounds 2 --hidden 256

The policy's vLLM engine is built first (as in a run); then the reference is built both ways from
the same folder -- an ``HFEngine`` loaded as ``workers/start.reference_rollouts`` loads it, and a
second ``VLLMEngine`` with the same settings -- and both sample the reference's batch of a step
(P prompts x ``--n`` answers, the run's ``reward.reference_samples``) ``--rounds`` times, after
one warm-up round each, alternating, with the same seeds. Printed: each one's build seconds and
median seconds per step, and how many steps the faster sampler needs to pay back its build.
The model is a random-init float32 Llama with the toy tokenizer (heads of 64: vLLM's CPU
attention needs head dim >= 32), as bench/vllm_rollout.py's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (heads of 64)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="P, the step's prompts")
    ap.add_argument("--n", type=int, default=1, help="reference answers per prompt (reward.reference_samples)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per engine (after 1 warm-up)")
    ap.add_argument("--kv-share", type=float, default=0.1, help="vLLM gpu_memory_utilization of each engine")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()

    import torch
    from transformers import LlamaForCausalLM

    from rldsl.runtime.models.loading import load_policy, load_tokenizer
    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.rollout.engines.hf import HFEngine
    from rldsl.runtime.rollout.engines.vllm import VLLMEngine
    from rldsl.runtime.toy import AdditionTask, build_tokenizer, tiny_config

    tok = build_tokenizer()
    config = tiny_config(tok, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, intermediate_size=args.hidden * 2,
                         max_position_embeddings=256)
    config.initializer_range = 0.1
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="rldsl-bench-ref-")
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    prompts = [ex.prompt for ex in AdditionTask().heldout_examples()[: args.prompts]]
    settings = dict(dtype="float32", gpu_memory_utilization=args.kv_share, enforce_eager=True, max_model_len=128)

    policy = VLLMEngine(folder, **settings)  # the run's own engine, present while the reference is built
    t = time.perf_counter()
    hf = HFEngine(load_policy(Path(folder), "float32").eval(), load_tokenizer(Path(folder)))
    build = {"hf": time.perf_counter() - t}
    t = time.perf_counter()
    second = VLLMEngine(folder, **settings)
    build["vllm"] = time.perf_counter() - t

    steps: dict[str, list[float]] = {"hf": [], "vllm": []}
    for r in range(args.rounds + 1):  # round 0 is the warm-up
        for name, engine in (("hf", hf), ("vllm", second)):
            params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=r)
            t = time.perf_counter()
            engine.generate(prompts, params)
            if r:
                steps[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in steps.items()}
    saved = med["hf"] - med["vllm"]
    payback = (build["vllm"] - build["hf"]) / saved if saved > 0 else float("inf")
    summary = {"hidden": args.hidden, "layers": args.layers, "batch": f"{args.prompts} x {args.n}",
               "max_new_tokens": args.max_new_tokens,
               "build_s": {k: round(v, 2) for k, v in build.items()},
               "step_s_median": {k: round(v, 4) for k, v in med.items()},
               "step_s": {k: [round(x, 4) for x in v] for k, v in steps.items()},
               "steps_to_pay_back_the_vllm_build": None if payback == float("inf") else round(payback)}
    print("| reference on | build (s) | per step, median (s) |")
    print("|---|---|---|")
    for k, label in (("hf", "HF engine, in the run's process"), ("vllm", "a second vLLM engine")):
        print(f"| {label} | {build[k]:.2f} | {med[k]:.4f} |")
    print("steps for the second vLLM engine to pay back its build:",
          "never (it is not faster per step)" if payback == float("inf") else f"{payback:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    second.close()
    policy.close()


if __name__ == "__main__":  # vLLM's engine core is a spawned process: it re-imports this file
    main()
