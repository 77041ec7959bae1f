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

from dataclasses import dataclass

import torch
from torch import Tensor

#: the per-node inputs this module makes, by their names in rldsl/inputs.py
NAMES = ("node_value", "parent_value", "root_value", "node_leaves", "parent_leaves")


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
    same = o.unsqueeze(1) == o.unsqueeze(0)             # [G(row), G(leaf), T]: leaf shares the row's token
    count = same.sum(1).to(torch.float64)                # [G, T]
    value = (same.to(torch.float64) * r.view(1, G, 1)).sum(1) / count
    root = r.mean()
    p_value = torch.empty(G, T, dtype=torch.float64)
    p_count = torch.empty(G, T, dtype=torch.float64)
    for i in range(G):
        # leaf sets shrink along a row: a node starts where the count changes
        starts = [0] + [t for t in range(1, T) if count[i, t] != count[i, t - 1]]
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
