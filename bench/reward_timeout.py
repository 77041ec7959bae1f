"""What ``reward.timeout_s`` costs on the normal path: each per-sample reward call in a worker
process (runtime/rewards/deadline.py) against the same call in the run's process (timeout_s=0),
per call, on B samples: a user's function that returns at once (the pipe's round trip alone) and
the ``math`` verifier on two kinds of answers. The best of N scorings after a warm-up (processes
started, caches filled).

    .venv/bin/python bench/reward_timeout.py            # B=512, best of 5
    .venv/bin/python bench/reward_timeout.py --samples 128 --repeats 9
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from rldsl.runtime.batch import RolloutBatch
from rldsl.runtime.rewards.functions import RewardFn


def batch(completions: list[str], answers: list[str]) -> RolloutBatch:
    B = len(completions)
    empty = torch.zeros(B, 1, dtype=torch.long)
    return RolloutBatch(prompt_ids=empty, prompt_mask=empty, response_ids=empty, response_mask=empty,
                        logprobs=torch.zeros(B, 1), finish_reason=["stop"] * B, prompts=["p"] * B,
                        completions=completions, group_size=1, answers=answers)


def per_call_us(spec: str, made: RolloutBatch, timeout_s: float, repeats: int) -> float:
    fn = RewardFn(spec, timeout_s=timeout_s)
    fn.score(made)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn.score(made)
        best = min(best, time.perf_counter() - start)
    return best / len(made.completions) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    B = args.samples
    folder = Path(tempfile.mkdtemp(prefix="rldsl-bench-"))
    (folder / "bench_rewards.py").write_text("def instant(prompt, completion, answer):\n    return 1.0\n")
    sys.path.insert(0, str(folder))
    os.chdir(folder)
    cases = {
        "a function returning 1.0, 300-character completions": (
            "bench_rewards:instant", batch(["x" * 300] * B, [""] * B)),
        "math on \\boxed{} answers": (
            "math", batch([f"so the answer is \\boxed{{{i % 7}}}" for i in range(B)], [str(i % 5) for i in range(B)])),
        "math on \\frac expressions": (
            "math", batch([f"Thus x = \\frac{{{i}}}{{{i + 1}}} + y^2" for i in range(B)],
                          [f"\\frac{{{i}}}{{{i + 1}}}+y^2" for i in range(B)])),
    }
    print(f"per call, B={B}, best of {args.repeats}: in the run's process (timeout_s=0) | in a worker process "
          "(timeout_s=30) | overhead")
    for label, (spec, made) in cases.items():
        inline = per_call_us(spec, made, 0.0, args.repeats)
        limited = per_call_us(spec, made, 30.0, args.repeats)
        print(f"  {label:55} {inline:8.1f} us | {limited:8.1f} us | {limited - inline:+8.1f} us")


if __name__ == "__main__":
    main()
