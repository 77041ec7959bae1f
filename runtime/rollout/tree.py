"""TreeRL's trees (``sampling tree``): the fork structure of a prompt's leaves, and the per-node
inputs a formula reads (``node_value``, ``parent_value``, ``root_value``, ``node_leaves``,
``parent_leaves``) computed from it and the leaves' rewards.

A prompt's group is a forest of generations (Hou et al. 2025, EPTree): M answers sampled from
the prompt, then forks, each sampled from an earlier generation's prefix. Every generation ends
in one leaf, and each leaf is one row holding its whole path from the prompt (the tokens it
shares with the rows it forked from appear in each of them: the authors train on every selected
path in full, without deduplication). The structure is two numbers per row of the group:

    parent[i]  the row whose prefix row i continues (a row of the same group, before i; -1 for
               the M answers sampled from the prompt alone)
    split[i]   the response position where row i's own tokens start: its tokens before it are
               its parent's (0 for the M answers)

A *node* of the tree is a run of tokens that the same leaves share (the authors' segments
between fork points, parallel_mcts.MCTSNode); its value is the mean reward of those leaves.
Whether two rows share a token is structural (they descend from the generation that sampled
it), never a comparison of token ids: two forks that sample the same token stay two nodes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rldsl.inputs import INPUTS

from ..batch import RolloutBatch, TokenRow
from ..records.rng import step_seed
from .engines.base import SamplingParams

#: the per-node inputs this module makes (rldsl/inputs.py: those whose source is the trees)
NAMES = tuple(i.name for i in INPUTS.values() if i.source == "tree")


@dataclass(frozen=True)
class Fork:
    """One row's place in its group's tree (samples.jsonl records it as ``tree``)."""

    parent: int  # the row (index within its group) it forked from; -1: sampled from the prompt
    split: int   # the response position its own tokens start at (its fork point)

    def plain(self) -> dict[str, int]:
        return {"parent": self.parent, "split": self.split}


def check_forks(forks: list[Fork]) -> None:
    """A group's forks describe a forest: a parent before its child, a fork point inside the
    parent's own span or later (at or after the parent's own split)."""
    for i, f in enumerate(forks):
        if f.parent == -1:
            if f.split != 0:
                raise ValueError(f"tree row {i}: sampled from the prompt, so its split must be 0; got {f.split}")
            continue
        if not 0 <= f.parent < i:
            raise ValueError(f"tree row {i}: parent {f.parent} is not an earlier row of its group")
        if f.split < forks[f.parent].split:
            raise ValueError(f"tree row {i}: fork point {f.split} lies before its parent's own tokens "
                             f"(from {forks[f.parent].split})")


def origins(forks: list[Fork], T: int) -> Tensor:
    """[G, T] int64: the row whose generation sampled each row's token at each position (the
    rows that share a token are those with the same origin there)."""
    t = torch.arange(T)
    out = torch.empty(len(forks), T, dtype=torch.int64)
    for i, f in enumerate(forks):
        own = torch.full((T,), i, dtype=torch.int64)
        out[i] = own if f.parent == -1 else torch.where(t >= f.split, own, out[f.parent])
    return out


def _subtree(forks: list[Fork], root: int) -> Tensor:
    """[G] bool: ``root`` and every row that descends from it."""
    inside = torch.zeros(len(forks), dtype=torch.bool)
    inside[root] = True
    for i, f in enumerate(forks):
        if f.parent != -1 and bool(inside[f.parent]):
            inside[i] = True
    return inside


def _empty_node(forks: list[Fork], o: int) -> int | None:
    """The row whose empty first segment is the parent of a node that starts at row ``o``'s own
    first token, or None. The authors' tree (tree_node.build_into_tree_format) cuts a generation
    at its forks' split indices; a fork at a generation's local index 0 leaves it an empty first
    segment whose leaves are the whole subtree: that segment is the parent of the generation's
    first real segment and of those forks. ``o`` itself when it has such forks, else the row
    ``o`` forked from when ``o`` is such a fork."""
    s = forks[o].split
    if any(f.parent == o and f.split == s for f in forks):
        return o
    p = forks[o].parent
    if p != -1 and forks[p].split == s:
        return p
    return None


def tree_inputs(forks: list[Fork], rewards: Tensor, T: int) -> dict[str, Tensor]:
    """The per-node inputs of one group: ``node_value`` / ``parent_value`` / ``node_leaves`` /
    ``parent_leaves`` [G, T] and ``root_value`` [G] (float64), from its forks and its leaves'
    rewards [G] (finite: a failed reward has no place in a tree's means).

    node_value     the mean reward of the leaves below the node that holds the row's token
    node_leaves    how many leaves those are (1 on a row's own last segment)
    parent_value   the same of the node's parent (the root for a first segment)
    parent_leaves  its leaves
    root_value     the mean reward of the group's leaves (the root: every leaf)
    """
    check_forks(forks)
    G = len(forks)
    r = rewards.detach().to(torch.float64).cpu()
    if r.shape != (G,) or not bool(torch.isfinite(r).all()):
        raise ValueError(f"tree rewards must be {G} finite numbers; got {r.tolist()}")
    o = origins(forks, T)
    # the leaves below each (origin, position): those whose token there the origin sampled
    below = torch.zeros(G, T, dtype=torch.float64).scatter_add_(0, o, torch.ones(G, T, dtype=torch.float64))
    total = torch.zeros(G, T, dtype=torch.float64).scatter_add_(0, o, r.view(G, 1).expand(G, T).contiguous())
    count = below.gather(0, o)                           # [G, T]: the leaves sharing the row's token
    value = total.gather(0, o) / count
    root = r.mean()
    p_value = torch.empty(G, T, dtype=torch.float64)
    p_count = torch.empty(G, T, dtype=torch.float64)
    # leaf sets shrink along a row: a node starts where the count changes
    change = torch.ones(G, T, dtype=torch.bool)
    change[:, 1:] = count[:, 1:] != count[:, :-1]
    for i in range(G):
        starts = change[i].nonzero().flatten().tolist()
        for start, end in zip(starts, starts[1:] + [T]):
            origin = int(o[i, start])
            host = _empty_node(forks, origin) if start == forks[origin].split else None
            if host is not None:
                leaves = _subtree(forks, host)
                pv, pc = r[leaves].mean(), float(leaves.sum())
            elif start == 0:
                pv, pc = root, float(G)
            else:
                pv, pc = value[i, start - 1], count[i, start - 1]
            p_value[i, start:end], p_count[i, start:end] = pv, pc
    return {"node_value": value, "parent_value": p_value, "root_value": root.expand(G).clone(),
            "node_leaves": count, "parent_leaves": p_count}


# ----------------------------------------------------------------------------- the sampler


@dataclass
class _Generation:
    """One sampled generation of a prompt's forest: the row it ends in."""

    tree: int                # which of the prompt's M answers' trees it belongs to
    parent: int              # the generation (row of the group) it forked from; -1: the prompt
    split: int               # where its own tokens start in the response
    ids: list[int]           # the whole response: the parent's tokens before split, then its own
    logprobs: list[float]    # the engine's logprob of each (the parent's for the shared ones)
    finish_reason: str
    own: list[int] = field(default_factory=list)  # positions of its own tokens

    def __post_init__(self) -> None:
        self.own = list(range(self.split, len(self.ids)))


def _fork_points(gens: list[_Generation], tree: int, n: int) -> list[tuple[int, int]]:
    """The ``n`` (generation, position) fork points of one tree: each generation's ``n`` own tokens
    with the highest -log pi (repeated when it has fewer, as the authors' get_max_entropy_tokens
    pads), pooled, the ``n`` highest of the tree kept (entropy_guided_chain)."""
    pool = []
    for g, gen in enumerate(gens):
        if gen.tree != tree or not gen.own:
            continue
        best = sorted(gen.own, key=lambda t: (gen.logprobs[t], t))[:n]  # highest -log pi first
        best = (best * n)[:n]
        pool += [(-gen.logprobs[t], g, t) for t in best]
    pool.sort(key=lambda x: (-x[0], x[1], x[2]))
    return [(g, t) for _, g, t in pool[:n]]


def _rows_of(batch: RolloutBatch) -> list[tuple[list[int], list[int], list[float], str]]:
    """(prompt ids, response ids, logprobs, finish reason) of each row of an engine's batch."""
    out = []
    for i in range(len(batch)):
        n = int(batch.response_mask[i].sum())
        out.append((batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist(), batch.response_ids[i, :n].tolist(),
                    batch.logprobs[i, :n].tolist(), batch.finish_reason[i]))
    return out


def sample_tree(engine: Any, prompts: list[str], params: SamplingParams, shape: Any) -> RolloutBatch:
    """``sampling tree(M, N, L, T)`` on an engine (``generate``, ``generate_ids``): for each prompt
    M answers, then L iterations that fork each tree at its N tokens of highest -log pi and sample
    T continuations from each prefix (a new request: the prompt's ids and the prefix's). Every
    generation is a row holding its whole path; ``batch.tree`` holds each row's (parent, split).
    A continuation may use what is left of ``max_new_tokens`` after its prefix, so every row
    stays within it. Seeded from ``params.seed`` (each iteration its own seed)."""
    if params.n != shape.rows:
        raise ValueError(f"sampling tree(M={shape.M}, N={shape.N}, L={shape.L}, T={shape.T}) makes "
                         f"{shape.rows} rows per prompt; the call asks for {params.n}")
    first = engine.generate(prompts, dataclasses.replace(params, n=shape.M))
    made = _rows_of(first)
    prompt_ids = [made[p * shape.M][0] for p in range(len(prompts))]
    forests = [[_Generation(m, -1, 0, ids, lps, fin) for m, (_, ids, lps, fin) in
                enumerate(made[p * shape.M:(p + 1) * shape.M])] for p in range(len(prompts))]
    for it in range(shape.L):
        asks = [(p, g, t) for p, gens in enumerate(forests) for tree in range(shape.M)
                for g, t in _fork_points(gens, tree, shape.N)]
        asks = [a for a in asks for _ in range(shape.T)]
        if not asks:
            continue
        budget = params.max_new_tokens - min(t for _, _, t in asks)
        seed = None if params.seed is None else step_seed(params.seed, it + 1, 0, "tree")
        out = engine.generate_ids([prompt_ids[p] + forests[p][g].ids[:t] for p, g, t in asks],
                                  dataclasses.replace(params, n=1, max_new_tokens=budget, seed=seed))
        for (p, g, t), (_, ids, lps, fin) in zip(asks, _rows_of(out)):
            left = params.max_new_tokens - t
            if len(ids) > left:  # past this row's own budget: cut, as max_new_tokens would have
                ids, lps, fin = ids[:left], lps[:left], "length"
            parent = forests[p][g]
            forests[p].append(_Generation(parent.tree, g, t, parent.ids[:t] + ids, parent.logprobs[:t] + lps, fin))
    tok = engine.tokenizer
    rows = [TokenRow(prompt_ids[p], gen.ids, gen.logprobs, gen.finish_reason, prompts[p],
                     tok.decode(gen.ids, skip_special_tokens=True))
            for p, gens in enumerate(forests) for gen in gens]
    batch = RolloutBatch.from_rows(rows, shape.rows, engine.pad_id)
    batch.tree = [(gen.parent, gen.split) for gens in forests for gen in gens]
    return batch
