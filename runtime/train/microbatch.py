"""Token-budget micro-batches: packing rows by token count and trimming their padding.

``train.max_tokens_per_microbatch`` bounds the tokens of every forward (update, old and
reference logprobs, critic). A micro-batch holds whole rows -- whole prompt groups when
the aggregation needs them (``prompt_mean``) or when every group fits in the budget (the
shared-prompt forward then still applies) -- and the loss of each micro-batch is taken over
the global denominator of its minibatch, so the summed gradients equal the whole-minibatch
gradient (docs/api.md, "Denominators").

Packing is balanced: the fewest bins whose largest-first greedy assignment (each unit to the
least-filled bin) keeps every bin within the budget. A unit larger than the budget gets a
bin of its own (rows are never split).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

import torch
from torch import Tensor

from ..batch import RolloutBatch


def row_tokens(batch: RolloutBatch) -> Tensor:
    """[B] real tokens of each row: prompt tokens + response tokens up to the first stop."""
    return batch.prompt_mask.long().sum(1) + batch.attention.long().sum(1)


def _lpt(sizes: Sequence[int], bins: int) -> list[list[int]]:
    """Largest first, each unit into the currently least-filled bin; bins of unit indices."""
    heap = [(0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (load + sizes[i], b))
    return out


def pack(sizes: Sequence[int], budget: int, min_bins: int = 1) -> list[list[int]]:
    """Unit indices per bin (each sorted ascending), at least ``min_bins`` bins, balanced.

    The bin count starts at max(min_bins, ceil(total / budget)) and grows until no bin
    exceeds ``budget`` (or every unit has its own bin). Bins may be empty only when
    ``min_bins`` exceeds the number of units.
    """
    if budget < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {budget}")
    n = len(sizes)
    if n == 0:
        return [[] for _ in range(min_bins)]
    k = max(min_bins, 1, math.ceil(sum(sizes) / budget))
    while True:
        bins = _lpt(sizes, k)
        if k >= n or all(sum(sizes[i] for i in b) <= budget for b in bins if len(b) > 1):
            return [sorted(b) for b in bins]
        k += 1


def rank_groups(group_tokens: Sequence[int], world: int) -> list[list[int]]:
    """Whole prompt groups for each of ``world`` ranks, balanced by real tokens (verl's
    ``balance_batch``): largest group first, each to the rank with the fewest tokens so far;
    each rank's groups in ascending order. The same on every rank (no randomness); a rank gets
    no group only when there are fewer groups than ranks."""
    return [sorted(b) for b in _lpt(group_tokens, world)]


def plan(batch: RolloutBatch, budget: int, *, whole_groups: bool,
         min_bins: int = 1) -> tuple[list[Tensor], bool]:
    """(row indices of each micro-batch, whether they are whole groups).

    Whole groups when ``whole_groups`` is required or every group fits in ``budget``.
    """
    tokens = row_tokens(batch).tolist()
    G = batch.group_size
    group_sizes = [sum(tokens[g * G:(g + 1) * G]) for g in range(len(tokens) // G)]
    by_group = whole_groups or max(group_sizes, default=0) <= budget
    if by_group:
        bins = pack(group_sizes, budget, min_bins)
        rows = [torch.tensor([g * G + j for g in b for j in range(G)], dtype=torch.long) for b in bins]
    else:
        bins = pack(tokens, budget, min_bins)
        rows = [torch.tensor(b, dtype=torch.long) for b in bins]
    return rows, by_group


def trim(batch: RolloutBatch) -> tuple[RolloutBatch, int]:
    """The batch without columns that are padding in every row, and its response width Tr'.

    Prompts are left padded and responses right padded, and positions count real tokens
    only (batch.position_ids_from_mask), so dropping all-pad columns changes no logit of a
    real token; the trimmed [b, Tr'] results are the first Tr' columns of the untrimmed ones.
    """
    tp = max(int(batch.prompt_mask.long().sum(1).max()), 1)
    tr = max(int(batch.attention.long().sum(1).max()), 1)
    Tp = batch.prompt_ids.shape[1]
    if tp == Tp and tr == batch.response_ids.shape[1]:
        return batch, tr
    return dataclasses.replace(
        batch, prompt_ids=batch.prompt_ids[:, Tp - tp:], prompt_mask=batch.prompt_mask[:, Tp - tp:],
        response_ids=batch.response_ids[:, :tr], response_mask=batch.response_mask[:, :tr],
        logprobs=batch.logprobs[:, :tr],
        response_attention=None if batch.response_attention is None else batch.response_attention[:, :tr],
        routed_experts=None if batch.routed_experts is None else batch.routed_experts[:, Tp - tp:Tp + tr]), tr


def widen(t: Tensor, width: int) -> Tensor:
    """[b, Tr'] -> [b, width]: zeros in the trimmed (masked) columns."""
    if t.shape[1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))
