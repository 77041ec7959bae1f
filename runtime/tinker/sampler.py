"""Sampling for ``asample``: many requests, each ``num_samples`` completions of one prompt, sampled
together in one KV-cached loop (the cookbook sends one-sample requests by the hundred: the
service gathers those waiting and calls :func:`sample` once).

Per token: z = logits / temperature, top-k then top-p (at least one token kept), a draw from a
generator of the call's own (seeded by the request's ``seed`` when it gives one: such a request is sampled in a batch of its own). A row stops
at a stop token (the request's ``stop`` ids, else the model's EOS ids; ``stop=[]``: none) or
when its decoded text holds a stop string: the token that completes it is kept, stop reason
``"stop"``; otherwise exactly ``max_tokens`` tokens, ``"length"``.

The logprob returned with each token is the sampling loop's own: log_softmax of the raw float32
logits it drew the token from (temperature 1, before top-k / top-p, as the trainer computes
them), on the sampler's weights -- the same model object and dtype a ``forward_backward`` runs,
so it equals the trainer's logprob of that token to float rounding (the KV-cached positions
against one full forward; ~1e-7 on the test models). ``prompt_logprobs`` come from the same
prefill. No second forward scores the completions (docs/tinker.md, "Speed").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..batch import position_ids_from_mask
from ..errors import TinkerRefused
from ..rollout.engines.base import left_pad, stop_token_ids
from .wire import Sequence


@dataclass
class SampleJob:
    """One ``asample`` request, read and checked."""

    prompt: list[int]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_strings: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] | None = None  # None: the model's EOS ids
    seed: int | None = None
    prompt_logprobs: bool = False
    result: list[Sequence] = field(default_factory=list)
    prompt_result: list[float] | None = None

    def group(self) -> tuple[Any, ...]:
        """Jobs with the same group sample in one batch; a seeded job alone, so that its seed
        alone decides its samples."""
        own = id(self) if self.seed is not None else None
        return (self.temperature, self.top_k, self.top_p, self.max_tokens, own)


def read_job(body: dict[str, Any], prompt: list[int], context: int | None, vocab: int) -> SampleJob:
    """A SampleJob from the client's JSON ``SampleRequest`` (a TinkerRefused 400 when it asks for
    something out of range: past the model's context, an empty prompt, a bad parameter)."""
    params = body.get("sampling_params") or {}
    stop = params.get("stop")
    strings: tuple[str, ...] = ()
    tokens: tuple[int, ...] | None = None
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and stop:
        strings = tuple(stop)
    elif isinstance(stop, list) and all(isinstance(s, int) for s in stop):
        tokens = tuple(stop)
    elif stop is not None:
        raise TinkerRefused(400, f"sample: stop must be a string, a list of strings or a list of token ids, got {stop!r}")
    job = SampleJob(prompt=prompt, num_samples=int(body.get("num_samples", 1)),
                    max_tokens=int(params.get("max_tokens") or 16),
                    temperature=float(params.get("temperature", 1.0)), top_k=int(params.get("top_k", -1)),
                    top_p=float(params.get("top_p", 1.0)), stop_strings=strings, stop_tokens=tokens,
                    seed=params.get("seed"), prompt_logprobs=bool(body.get("prompt_logprobs")))
    if not prompt:
        raise TinkerRefused(400, "sample: the prompt has no tokens")
    if any(not 0 <= t < vocab for t in prompt):
        raise TinkerRefused(400, f"sample: a prompt token is outside the model's vocabulary of {vocab}")
    if job.num_samples < 1 or job.max_tokens < 1:
        raise TinkerRefused(400, "sample: num_samples and max_tokens must be >= 1")
    if job.temperature < 0 or not 0 < job.top_p <= 1 or job.top_k == 0:
        raise TinkerRefused(400, f"sample: temperature >= 0, 0 < top_p <= 1, top_k -1 or >= 1 (got {params})")
    if context is not None and len(prompt) + job.max_tokens > context:
        raise TinkerRefused(400, f"sample: prompt of {len(prompt)} tokens + max_tokens {job.max_tokens} is past "
                                 f"the model's context of {context} positions")
    return job


def _filter(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -float("inf"))
    if top_p < 1:
        sorted_z, order = torch.sort(z, descending=False)
        remove = sorted_z.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        remove[..., -1:] = False
        z = z.masked_fill(remove.scatter(1, order, remove), -float("inf"))
    return z


@dataclass
class _Drawn:
    """What :func:`_generate` returns: per row (each job's num_samples rows in turn) the completion's
    tokens and their logprobs; per job, the logprobs of its prompt's tokens 1.. (from the prefill)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    prompt_logprobs: list[list[float]]


def _picked(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[token] per row: fp32 logits [b, V], tokens [b] -> [b]."""
    return logits.gather(-1, token[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def _generate(model: Any, tokenizer: Any, jobs: list[SampleJob]) -> _Drawn:
    """The completions' tokens and logprobs. Each prompt is prefilled once for its samples (its
    cache rows then repeated), and a row that has stopped leaves the batch, as the HF engine's
    sampler does (rollout/engines/hf.py)."""
    head = jobs[0]
    rows = [j for j in jobs for _ in range(j.num_samples)]
    ids, mask = left_pad([j.prompt for j in jobs], tokenizer.pad_token_id or 0)
    eos = stop_token_ids(tokenizer, model)
    stops = [set(r.stop_tokens) if r.stop_tokens is not None else set(eos) for r in rows]
    generator = torch.Generator()
    generator.manual_seed(head.seed if head.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    out: list[list[int]] = [[] for _ in rows]
    out_lp: list[list[float]] = [[] for _ in rows]
    pos = position_ids_from_mask(mask)
    res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    prompt_lp = _prompt_logprobs(res.logits, ids, jobs)
    repeat = torch.repeat_interleave(torch.arange(len(jobs)), torch.tensor([j.num_samples for j in jobs]))
    cache = res.past_key_values
    cache.batch_select_indices(repeat)
    logits, mask, next_pos = res.logits[:, -1].float()[repeat], mask[repeat], pos[repeat, -1:] + 1
    alive = list(range(len(rows)))  # the row of each sequence still running
    for _ in range(head.max_tokens):
        if head.temperature == 0:
            token = logits.argmax(-1)
        else:
            z = _filter(logits / head.temperature, head.top_k, head.top_p)
            token = torch.multinomial(torch.softmax(z, -1), 1, generator=generator).squeeze(1)
        keep = []
        for k, (i, t, lp) in enumerate(zip(alive, token.tolist(), _picked(logits, token).tolist())):
            out[i].append(t)
            out_lp[i].append(lp)
            if not (t in stops[i] or (rows[i].stop_strings and any(
                    s in tokenizer.decode(out[i], skip_special_tokens=False) for s in rows[i].stop_strings))):
                keep.append(k)
        if not keep or len(out[alive[0]]) == head.max_tokens:
            break
        if len(keep) < len(alive):
            index = torch.tensor(keep)
            cache.batch_select_indices(index)
            alive, token, mask, next_pos = [alive[k] for k in keep], token[index], mask[index], next_pos[index]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        res = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos,
                    past_key_values=cache, use_cache=True)
        logits, next_pos = res.logits[:, -1].float(), next_pos + 1
    return _Drawn(out, out_lp, prompt_lp)


def _prompt_logprobs(logits: torch.Tensor, ids: torch.Tensor, jobs: list[SampleJob]) -> list[list[float]]:
    """Per job asking for them, the logprobs of its prompt's tokens 1.. from the prefill's logits
    [P, Tp, V] (prompts left padded); [] for the others."""
    out: list[list[float]] = []
    Tp = ids.shape[1]
    for k, j in enumerate(jobs):
        if not j.prompt_logprobs or len(j.prompt) < 2:
            out.append([])
            continue
        start = Tp - len(j.prompt)  # the prompt's first column
        out.append(_picked(logits[k, start:Tp - 1].float(), ids[k, start + 1:]).tolist())
    return out


def sample(model: Any, tokenizer: Any, jobs: list[SampleJob]) -> None:
    """Fill each job's ``result`` (and ``prompt_result``): one batch per group of parameters."""
    groups: dict[tuple[Any, ...], list[SampleJob]] = {}
    for j in jobs:
        groups.setdefault(j.group(), []).append(j)
    for group in groups.values():
        drawn = _generate(model, tokenizer, group)
        rows = [j for j in group for _ in range(j.num_samples)]
        for j, prompt_lp in zip(group, drawn.prompt_logprobs):
            j.result = []
            if j.prompt_logprobs:
                j.prompt_result = [float("nan")] + prompt_lp
        for r, c, lp in zip(rows, drawn.tokens, drawn.logprobs):
            stopped = len(c) < r.max_tokens or _ends_on_stop(r, c, tokenizer, model)
            r.result.append(Sequence(c, lp, stopped))


def _ends_on_stop(job: SampleJob, completion: list[int], tokenizer: Any, model: Any) -> bool:
    """A completion of exactly max_tokens tokens whose last token stopped it."""
    stops = set(job.stop_tokens) if job.stop_tokens is not None else stop_token_ids(tokenizer, model)
    if completion[-1] in stops:
        return True
    text = tokenizer.decode(completion, skip_special_tokens=False)
    return any(s in text for s in job.stop_strings)
