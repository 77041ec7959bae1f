"""TreeRL (docs/new_algorithms.md, second table): the per-node inputs of a tree
(runtime/rollout/tree.py) and algorithms/examples/treerl.rl against a float64 transcription of
the authors' tree advantage on fixed trees, eager and compiled (the second round's pattern,
test_new_algorithms_2.py).

The reference builds the authors' tree from the same forks -- generations cut into segments at
their children's split indices, a fork at a generation's local index 0 leaving it an empty first
segment (tree_node.build_into_tree_format) -- and computes the value of each segment as they do;
it shares no code with runtime/rollout/tree.py, which finds the nodes from the rows' origins.
"""
from __future__ import annotations

import math

import pytest
import torch
from test_new_algorithms import DT, EAGER_AND_COMPILED, TOL, _logp_ent, _spec
from test_new_algorithms_2 import _check

from rldsl.runtime.rollout.tree import Fork, tree_inputs


@pytest.fixture(params=EAGER_AND_COMPILED)
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


# ------------------------------------------------------------------ the authors' tree, transcribed


class _Node:
    """parallel_mcts.MCTSNode's fields that the value reads."""

    def __init__(self, positions: range, parent: "_Node | None", terminal: bool = False, R: float = 0.0):
        self.positions, self.parent, self.terminal, self.R = positions, parent, terminal, R
        self.children: list[_Node] = []
        self.n = 0          # terminal_in_subtree
        self.sel = 0        # selected_terminal_in_subtree
        self.acc = 0.0      # accumulated_value


def treerl_adv(forks: list[Fork], lengths: list[int], rewards: list[float], T: int) -> tuple[torch.Tensor, bool]:
    """github.com/THUDM/TreeRL @ f0edbea (its EPTree entered at 563dbca), tree_node.py
    build_into_tree_format (use_all_terminals: every leaf is a row; use_weighted_value with
    weighted_value_style="sqrt" and overall_norm_style "none", scripts/treerl-qw14b.sh and
    train_reinforce_ray.py's defaults): leaf R minus the leave-one-out mean of the others
    (leaf_normalize), summed up the tree (leaf_backpropagate), each node's sum divided by
    sqrt(its selected leaves) (compute_weighted_update); parallel_mcts.py gather_paths with
    use_state_value_reward: per path node value = child - parent with V = sum / leaves
    (path_from_root_to_node), a |value| < 1e-8 replaced by the previous node's (fill_in_paths),
    then + V(child); experience_maker.py _generate_vllm_mcts gives every token of a node that
    value. ``lengths[g]``: generation g's own tokens. Returns [G, T] and whether fill_in_paths
    replaced a value."""
    G = len(forks)
    local = [f.split - (forks[f.parent].split if f.parent >= 0 else 0) for f in forks]
    kids = {g: [k for k in range(G) if forks[k].parent == g] for g in range(G)}
    leaf_of: dict[int, _Node] = {}
    leaves: list[_Node] = []

    def build(g: int, parent: _Node) -> _Node:  # build_tree_node
        children = sorted(kids[g], key=lambda k: local[k])
        splits = [local[k] for k in children]
        base = forks[g].split
        first = splits[0] if splits else lengths[g]
        node = _Node(range(base, base + first), parent, not splits, rewards[g] if not splits else 0.0)
        if node.terminal:
            leaves.append(node)
            leaf_of[g] = node
        cur, start, i = node, first, 0
        while i < len(children):
            group, at = [], splits[i]
            while i < len(children) and splits[i] == at:
                group.append(children[i])
                i += 1
            last = i == len(children)
            nxt = lengths[g] if last else splits[i]
            seg = _Node(range(base + start, base + nxt), cur, last, rewards[g] if last else 0.0)
            cur.children.append(seg)
            if last:
                leaves.append(seg)
                leaf_of[g] = seg
            for c in group:
                cur.children.append(build(c, cur))
            start, cur = nxt, seg
        return node

    root = _Node(range(0), None)
    root.children = [build(g, root) for g in range(G) if forks[g].parent == -1]
    total = sum(x.R for x in leaves)
    for x in leaves:  # leaf_normalize, leaf_backpropagate
        x.R = x.R - (total - x.R) / (len(leaves) - 1)
        x.acc = x.R
        x.n += 1
        p = x.parent
        while p:
            p.n += 1
            p.acc += x.acc
            p = p.parent
    for x in leaves:  # selected_backpropagate (every leaf selected)
        x.sel += 1
        p = x.parent
        while p:
            p.sel += 1
            p = p.parent

    def weighted(node: _Node) -> None:  # compute_weighted_update, sqrt
        if node.sel == 0:
            return
        node.acc = node.acc / math.sqrt(node.sel)
        for c in node.children:
            weighted(c)

    weighted(root)
    out = torch.zeros(G, T, dtype=DT)
    filled = False
    for g in range(G):
        path, node = [], leaf_of[g]
        while node.parent is not None:  # path_from_root_to_node
            child, parent = node.acc / node.n, node.parent.acc / node.parent.n
            path.append({"positions": node.positions, "value": child - parent, "state_value": child})
            node = node.parent
        path = path[::-1]
        for i in range(1, len(path)):  # fill_in_paths
            if abs(path[i]["value"]) < 1e-8:
                filled = filled or abs(path[i - 1]["value"]) >= 1e-8
                path[i]["value"] = path[i - 1]["value"]
        for step in path:  # use_state_value_reward
            for t in step["positions"]:
                out[g, t] = step["value"] + step["state_value"]
    return out, filled


# ------------------------------------------------------------------ fixed trees

#: two levels, uneven branching: answers 0 and 1 (M = 2); 0 forked twice at 3 (2, 3), 1 once at
#: 1 (4) and once at 0 (7: the root's empty segment); 2 forked at 5 (5), 3 at its own first token
#: (6: an empty first segment of 3)
TWO_LEVELS = [Fork(-1, 0), Fork(-1, 0), Fork(0, 3), Fork(0, 3), Fork(1, 1), Fork(2, 5), Fork(3, 3), Fork(1, 0)]
TWO_LEVELS_OWN = [8, 6, 4, 6, 5, 3, 2, 4]  # each generation's own tokens
#: the authors' released shape, M = 2, N = 1, L = 1, T = 1, then a second iteration (L = 2)
SMALL = [Fork(-1, 0), Fork(-1, 0), Fork(0, 2), Fork(1, 4), Fork(2, 3), Fork(3, 5)]
SMALL_OWN = [5, 7, 4, 3, 3, 2]

TREES = {
    "two_levels": (TWO_LEVELS, TWO_LEVELS_OWN, [[1, 0, 0, 1, 1, 0, 1, 0], [0, 0, 1, 0, 0, 0, 0, 1]]),
    "uneven_rewards": (TWO_LEVELS, TWO_LEVELS_OWN, [[0.9, 0.1, 0.4, 1.0, 0.0, 0.25, 0.7, 0.3],
                                                     [1, 1, 1, 0, 1, 1, 0, 1]]),
    "equal_rewards": (TWO_LEVELS, TWO_LEVELS_OWN, [[1] * 8, [0] * 8]),
    "small": (SMALL, SMALL_OWN, [[1, 0, 0, 1, 1, 0], [0, 1, 1, 1, 0, 0]]),
}


def _tree_batch(name: str, seed: int = 60) -> tuple[dict, dict, torch.Tensor, bool]:
    """Two prompts with the same tree and their own rewards: the batch (logits as the second
    round's), the per-node inputs (runtime/rollout/tree.py), the reference advantages and
    whether the reference's fill_in_paths replaced a value."""
    forks, own, rewards = TREES[name]
    G = len(forks)
    lengths = [f.split + n for f, n in zip(forks, own)]
    T = max(lengths)
    made = [tree_inputs(forks, torch.tensor(r, dtype=DT), T) for r in rewards]
    inputs = {k: torch.cat([m[k] for m in made]) for k in made[0]}
    refs = [treerl_adv(forks, own, [float(x) for x in r], T) for r in rewards]
    mask = (torch.arange(T).expand(G, T) < torch.tensor(lengths).unsqueeze(-1)).to(DT).repeat(2, 1)
    g = torch.Generator().manual_seed(seed)
    B, V = 2 * G, 6
    z = 1.5 * torch.randn(B, T, V, generator=g, dtype=DT)
    b = dict(z=z, z_old=z + 0.5 * torch.randn(B, T, V, generator=g, dtype=DT),
             z_ref=z + 0.3 * torch.randn(B, T, V, generator=g, dtype=DT),
             y=torch.randint(0, V, (B, T), generator=g), mask=mask,
             r=torch.tensor(sum(rewards, []), dtype=DT))
    want = torch.cat([a for a, _ in refs]) * mask
    return b, inputs, want, any(f for _, f in refs)


def treerl_reference(logp, ent, old, ref, adv, mask):  # noqa: ANN001, ANN201
    """OpenRLHF's openrlhf/models/loss.py PolicyLoss in the TreeRL repository (clip_eps 0.2):
    -min(ratio A, clamp(ratio, 1 - 0.2, 1 + 0.2 * 1.3) A), masked_mean over each sequence's
    tokens, then the mean over sequences; no KL term (the script sets no init_kl_coef)."""
    ratio = torch.exp(logp - old)
    loss = -torch.min(ratio * adv, ratio.clamp(1 - 0.2, 1 + 0.2 * 1.3) * adv)
    return ((loss * mask).sum(-1) / mask.sum(-1)).mean()


@pytest.mark.parametrize("tree", sorted(TREES))
def test_treerl_tree_advantages(mode: str, tree: str) -> None:
    fn = _spec("treerl", mode)
    b, inputs, want, filled = _tree_batch(tree)
    G = len(TREES[tree][0])
    est = fn.estimate(b["r"].float(), G, b["mask"].float(), **{k: v.float() for k, v in inputs.items()})
    torch.testing.assert_close(est.advantages.double(), want, rtol=0, atol=TOL)
    assert not filled  # fill_in_paths (not in the formula) does not act on these trees
    if tree == "equal_rewards":  # every node's value is the root's: no advantage, no gradient
        assert float(want.abs().max()) == 0.0
        return
    # a token's advantage depends on its node: rows of one leaf's path differ along it
    assert float(want.abs().max()) > 0.1
    assert any(len(set(want[i][b["mask"][i] > 0].tolist())) > 1 for i in range(want.shape[0]))
    _check(fn, b, est.advantages.double(), treerl_reference, group_size=G)


def test_tree_inputs_of_a_fork_at_a_generations_first_token() -> None:
    """Row 6 forks row 3 at row 3's own first token: both hang below row 3's empty first
    segment (the authors' tree), whose leaves are rows 3 and 6, not below row 0's segment."""
    forks, own, rewards = TREES["two_levels"]
    T = max(f.split + n for f, n in zip(forks, own))
    made = tree_inputs(forks, torch.tensor(rewards[0], dtype=DT), T)
    assert made["node_leaves"][3, 3] == 1 and made["parent_leaves"][3, 3] == 2
    assert made["node_leaves"][6, 3] == 1 and made["parent_leaves"][6, 3] == 2
    assert made["node_leaves"][2, 3] == 2 and made["parent_leaves"][2, 3] == 5  # rows 0, 2, 3, 5, 6
    assert made["node_leaves"][0, 0] == 5 and made["parent_leaves"][0, 0] == 8  # the root
    assert made["parent_leaves"][1, 0] == 3  # row 1's first segment hangs below its empty one (7)
    assert made["root_value"].tolist() == [0.5] * 8


def test_tree_inputs_refuse_a_broken_tree() -> None:
    with pytest.raises(ValueError, match="parent 2 is not an earlier row"):
        tree_inputs([Fork(-1, 0), Fork(2, 1), Fork(0, 1)], torch.zeros(3), 4)
    with pytest.raises(ValueError, match="finite"):
        tree_inputs([Fork(-1, 0), Fork(0, 1)], torch.tensor([1.0, float("nan")]), 4)


def test_explain_says_how_many_rows_a_tree_makes() -> None:
    from rldsl import explain, registry

    notes = explain.fact_notes(registry.get("sampling", "tree"), {"M": 6, "N": 2, "L": 1, "T": 2})
    assert "carried out by the runtime: a tree per prompt, G = M (1 + L N T) = 30 rows (rollout.n)" in notes
