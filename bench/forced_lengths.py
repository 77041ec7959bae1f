"""Long-tailed answer lengths, the same on both sides of bench/step_phases.py (``--lengths lognormal``).

Each answer stops at a drawn length L, as a real answer stops at its EOS: while sampling, at
answer position t of row r the stop tokens are barred for t < L - 1 and EOS is forced at
t = L - 1 (the row's EOS injection; ``min_new_tokens`` is not used). Each side then samples as it
would at free lengths: rldsl's sampler drops a finished row from the batch
(``HFEngine._sample``), TRL's ``model.generate`` keeps every row in the batch until the last one
ends, padding the finished ones. The hook sits in ``HFEngine._logits`` on the rldsl side (this
file run as the ``rldsl`` command) and in a logits processor handed to TRL's
``model.generate``; the tokens, the reward, the logprob forwards and the update are both sides'
own.

The lengths: call c of the step's generation (c = 0, 1, ... per run), row r of its B = P x G rows
(groups contiguous on both sides) gets

    L = clip(round(exp(mu + sigma z)), 2, N),   z ~ Normal(0, 1) from numpy's default_rng([seed, c])
    mu = ln(N / 8), sigma = 1

a log-normal with median N / 8: most answers far shorter than the limit N, about 2 % cut at N.
"""
from __future__ import annotations

import math
import sys

SIGMA = 1.0


def lengths(seed: int, call: int, rows: int, limit: int) -> list[int]:
    """The drawn answer lengths of one generation call (module docstring)."""
    import numpy as np
    z = np.random.default_rng([seed, call]).standard_normal(rows)
    mu = math.log(limit / 8)
    return [int(min(max(round(math.exp(mu + SIGMA * x)), 2), limit)) for x in z]


class Draws:
    """The lengths of successive generation calls of one run."""

    def __init__(self, seed: int):
        self.seed, self.call = seed, 0

    def next(self, rows: int, limit: int) -> list[int]:
        out = lengths(self.seed, self.call, rows, limit)
        self.call += 1
        return out


def force(scores, lengths, t: int, stops: list[int], eos: int):
    """``scores`` [b, V] of answer position ``t`` for rows whose drawn lengths are ``lengths``
    [b]: stop tokens barred where t < L - 1, EOS forced (every other token barred) where t = L - 1;
    rows past their length are left as they are (their token is padding)."""
    import torch
    L = lengths.to(scores.device)
    scores = scores.clone()
    early = L - 1 > t  # [b]
    if bool(early.any()):
        barred = scores[early]
        barred[:, stops] = -float("inf")
        scores[early] = barred
    last = L - 1 == t  # [b]
    if bool(last.any()):
        row = torch.full_like(scores[last], -float("inf"))
        row[:, eos] = 0.0
        scores[last] = row
    return scores


def install_rldsl(seed: int) -> None:
    """Stop every answer ``HFEngine`` samples at its drawn length (module docstring)."""
    import torch

    from rldsl.runtime.rollout.engines.hf import HFEngine

    draws = Draws(seed)
    padded, logits = HFEngine._generate_padded, HFEngine._logits
    state: dict = {}

    def generate_padded(self, unique_ids, unique_mask, prompts, params):
        state["L"] = torch.tensor(draws.next(unique_ids.shape[0] * params.n, params.max_new_tokens))
        state["t"] = 0
        try:
            return padded(self, unique_ids, unique_mask, prompts, params)
        finally:
            state.clear()

    def forced_logits(self, **inputs):
        z = logits(self, **inputs)
        if "L" not in state:
            return z
        t, L = state["t"], state["L"]
        state["t"] = t + 1
        stops = sorted(self.stop_ids)
        if t == 0:  # the prefill: one row per prompt, every drawn length >= 2
            return force(z, torch.full((z.shape[0],), 2 ** 30), 0, stops, self.eos_id)
        alive = L > t  # the sampler keeps exactly the rows that have not ended, in order
        if int(alive.sum()) != z.shape[0]:
            raise RuntimeError(f"forced lengths: {z.shape[0]} rows running at position {t}, "
                               f"expected {int(alive.sum())}")
        return force(z, L[alive], t, stops, self.eos_id)

    HFEngine._generate_padded = generate_padded
    HFEngine._logits = forced_logits


def install_trl(trainer, seed: int, limit: int) -> None:
    """Stop every answer TRL's ``model.generate`` samples at its drawn length (module docstring)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    draws = Draws(seed)
    eos = trainer.eos_token_ids[0]
    stops = sorted(set(trainer.eos_token_ids))

    class Forced(LogitsProcessor):
        def __init__(self, L, prompt_len):
            self.L, self.prompt_len = L, prompt_len

        def __call__(self, input_ids, scores):
            return force(scores, self.L, input_ids.shape[1] - self.prompt_len, stops, eos)

    model = trainer.model
    plain = model.generate

    def generate(*a, **k):
        ids = k["input_ids"] if "input_ids" in k else a[0]
        L = torch.tensor(draws.next(ids.shape[0], limit))
        extra = LogitsProcessorList([Forced(L, ids.shape[1])])
        if k.get("logits_processor"):
            extra = LogitsProcessorList([*k["logits_processor"], *extra])
        return plain(*a, **{**k, "logits_processor": extra})

    model.generate = generate


if __name__ == "__main__":  # forced_lengths.py SEED rldsl-args...: the rldsl command with drawn lengths
    install_rldsl(int(sys.argv[1]))
    from rldsl.cli import app
    sys.argv = ["rldsl", *sys.argv[2:]]
    app()
