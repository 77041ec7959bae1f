"""Sampling for ``asample``: many requests, each ``num_samples`` completions of one prompt, sampled
together in one KV-cached loop (the cookbook sends one-sample requests by the hundred: the
service gathers those waiting and calls :func:`sample` once, and those that arrive while it runs
join the running loop at its next token: continuous batching).

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
from typing import Any, Callable

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


def _picked(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[token] per row: fp32 logits [b, V], tokens [b] -> [b]."""
    return logits.gather(-1, token[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


@dataclass
class _Batch:
    """The rows a sampling loop is generating: per row still running its job, its tokens so far
    and their logprobs; the KV cache, attention mask and next position of those rows; the logits
    each will draw its next token from."""

    rows: list[SampleJob]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    cache: Any
    mask: torch.Tensor
    next_pos: torch.Tensor
    logits: torch.Tensor

    def keep(self, index: list[int]) -> None:
        """Only the rows at ``index`` go on."""
        if len(index) == len(self.rows):
            return
        select = torch.tensor(index, dtype=torch.long)
        self.cache.batch_select_indices(select)
        self.rows = [self.rows[k] for k in index]
        self.tokens = [self.tokens[k] for k in index]
        self.logprobs = [self.logprobs[k] for k in index]
        self.mask, self.next_pos, self.logits = self.mask[select], self.next_pos[select], self.logits[select]

    def join(self, other: _Batch) -> None:
        """Add ``other``'s rows (just prefilled): both caches and masks left-padded to the longer
        one (a padded column is masked, and each row keeps its own positions), then stacked."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left(mine.keys, width, 2), _left(theirs.keys, width, 2)])
            mine.values = torch.cat([_left(mine.values, width, 2), _left(theirs.values, width, 2)])
        self.mask = torch.cat([_left(self.mask, width, 1), _left(other.mask, width, 1)])
        self.rows, self.tokens, self.logprobs = (self.rows + other.rows, self.tokens + other.tokens,
                                                 self.logprobs + other.logprobs)
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.logits = torch.cat([self.logits, other.logits])


def _left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``x`` left-padded with zeros along ``dim`` to ``width``."""
    if x.shape[dim] == width:
        return x
    shape = list(x.shape)
    shape[dim] = width - x.shape[dim]
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _joinable(cache: Any) -> bool:
    """A cache whose layers are plain key/value tensors (no sliding window, no recurrent state):
    rows prefilled apart can be stacked into it."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer).__name__ == "DynamicLayer" for layer in layers)


def _prefill(model: Any, tokenizer: Any, jobs: list[SampleJob]) -> _Batch:
    """Each job's prompt prefilled once, its cache row then repeated for its samples; the
    prompts' own logprobs go to the jobs that ask for them."""
    ids, mask = left_pad([j.prompt for j in jobs], tokenizer.pad_token_id or 0)
    pos = position_ids_from_mask(mask)
    res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    for j, lp in zip(jobs, _prompt_logprobs(res.logits, ids, jobs)):
        j.result = []
        j.prompt_result = [float("nan")] + lp if j.prompt_logprobs else None
    repeat = torch.repeat_interleave(torch.arange(len(jobs)), torch.tensor([j.num_samples for j in jobs]))
    res.past_key_values.batch_select_indices(repeat)
    rows = [j for j in jobs for _ in range(j.num_samples)]
    return _Batch(rows, [[] for _ in rows], [[] for _ in rows], res.past_key_values, mask[repeat],
                  pos[repeat, -1:] + 1, res.logits[:, -1].float()[repeat])


Join = Callable[[], list[SampleJob]]
Done = Callable[[SampleJob], None]


@torch.no_grad()
def _generate(model: Any, tokenizer: Any, jobs: list[SampleJob], join: Join | None, done: Done) -> None:
    """Sample ``jobs`` (one group of parameters) in one KV-cached loop. A row that has stopped
    leaves the batch, as the HF engine's sampler does (rollout/engines/hf.py), and a job is
    ``done`` once its last row has; requests of the same group that arrive while the loop runs
    (``join()``) are prefilled and enter it at the next token (continuous batching: a recipe's
    requests reach the server one by one, and on a busy machine further apart than the gather
    window: each would otherwise wait for the loop before it, then run a loop of its own)."""
    head = jobs[0]
    eos = stop_token_ids(tokenizer, model)
    left = {id(j): j.num_samples for j in jobs}
    generator = torch.Generator()
    generator.manual_seed(head.seed if head.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    batch = _prefill(model, tokenizer, jobs)
    if not _joinable(batch.cache):
        join = None
    while batch.rows:
        if head.temperature == 0:
            token = batch.logits.argmax(-1)
        else:
            z = _filter(batch.logits / head.temperature, head.top_k, head.top_p)
            token = torch.multinomial(torch.softmax(z, -1), 1, generator=generator).squeeze(1)
        keep = []
        for k, (t, lp) in enumerate(zip(token.tolist(), _picked(batch.logits, token).tolist())):
            row, out = batch.rows[k], batch.tokens[k]
            out.append(t)
            batch.logprobs[k].append(lp)
            stopped = t in (set(row.stop_tokens) if row.stop_tokens is not None else eos) or bool(
                row.stop_strings and any(s in tokenizer.decode(out, skip_special_tokens=False)
                                         for s in row.stop_strings))
            if not stopped and len(out) < row.max_tokens:
                keep.append(k)
                continue
            row.result.append(Sequence(out, batch.logprobs[k], stopped))
            left[id(row)] -= 1
            if not left[id(row)]:
                done(row)
        batch.keep(keep)
        if keep:
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(keep), 1)], dim=1)
            res = model(input_ids=token[torch.tensor(keep, dtype=torch.long)][:, None], attention_mask=batch.mask,
                        position_ids=batch.next_pos, past_key_values=batch.cache, use_cache=True)
            batch.logits, batch.next_pos = res.logits[:, -1].float(), batch.next_pos + 1
        arrived = join() if join is not None else []
        if arrived:
            left.update({id(j): j.num_samples for j in arrived})
            fresh = _prefill(model, tokenizer, arrived)
            if keep:
                batch.join(fresh)
            else:
                batch = fresh


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


def sample(model: Any, tokenizer: Any, jobs: list[SampleJob],
           join: Callable[[tuple[Any, ...]], list[SampleJob]] | None = None, done: Done | None = None) -> None:
    """Fill each job's ``result`` (and ``prompt_result``): one loop per group of parameters.
    ``join(group)``, when given, returns the requests of that group that arrived since (they
    enter the running loop); ``done(job)`` is called once a job's samples are all drawn."""
    groups: dict[tuple[Any, ...], list[SampleJob]] = {}
    for j in jobs:
        groups.setdefault(j.group(), []).append(j)
    for key, group in groups.items():
        _generate(model, tokenizer, group, (lambda key=key: join(key)) if join is not None else None,
                  done or (lambda job: None))
