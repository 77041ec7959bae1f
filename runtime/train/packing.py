"""Padding-free forwards: several sequences laid end to end in one row (``train.packing``).

A padded forward pushes B x T tokens through every layer, T the longest row's length; with
long-tailed answer lengths most of them are padding. A packed forward lays the real tokens of
the B rows end to end in R rows of at most ``row_tokens`` tokens each (whole sequences, the
rows balanced by largest-first assignment), with position ids restarting at 0 at every
sequence and no attention mask: transformers then finds the sequence boundaries from the
restarting positions (``masking_utils.find_packed_sequence_indices``) and keeps attention
within each sequence (a block-diagonal causal mask for sdpa / eager; varlen kernels for
flash attention). Positions count real tokens only, as ``batch.position_ids_from_mask`` does,
so every real token sees exactly the keys and positions it sees in the padded row: logprobs,
entropies and values are the padded path's, up to floating-point summation order.

Shapes: B rows of T = Tp + Tr tokens (prompt left padded, response right padded), n_b real
tokens in row b, R packed rows of S tokens (S <= ``row_tokens`` unless one sequence is longer),
M real response tokens in all, H hidden size.

On CPU the masked attention is still computed over the whole packed row (S x S scores per
head), which is why rows are bounded: ``row_tokens`` near the longest sequence keeps the
attention cost near the padded forward's while the linear layers see only real tokens.

Shared prompts (:func:`shared_packed_rows`): when the G rows of each group share one prompt,
a row holds a group's prompt once and several of its responses after it, each response
attending to the prompt and to itself only -- a tree, not a chain -- so the prompt is pushed
once per row that holds the group instead of once per sample. Restarting positions cannot say
that, so these rows carry their own 4D attention mask (boolean for sdpa, additive for eager);
responses count positions on from the prompt's length as in the padded row. Taken for models
whose attention takes such a mask and whose layers all attend over the whole context (a sliding
window would be bypassed by a custom mask), checked once per model like the plain layout.

Not every architecture takes plain packed rows (OPT builds its causal mask without the
position ids, so it never sees where a packed sequence restarts): :func:`packing_supported`
checks each model once on two short sequences, and a model that fails falls back to padded
forwards with one warning -- or to shared-prompt rows, whose own mask it does take.
:func:`packed_layout` picks the layout of a forward.
"""
from __future__ import annotations

import heapq
import itertools
import math
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..models import moe
from ..models.loading import plain_kv_cache
from .microbatch import pack


@dataclass(frozen=True)
class PackedRows:
    """B padded rows laid out as R packed rows, and where each response token's state is.

    input_ids     [R, S]  the real tokens of whole sequences, end to end, then filler
    position_ids  [R, S]  0, 1, ... restarting at every sequence (the filler is one more)
    predictor     [M]     flat index into [R*S] of the state predicting each real response token
    target        [M]     flat index into the padded [B*T] ids of that token
    out           [M]     flat index into [B*Tr] where its result goes
    lengths       [B]     tokens of each sequence fed to the model: n_b - 1 (its last token
                          predicts nothing, as in the padded forward)
    placed                the real tokens laid in the rows: sum(lengths), or fewer in
                          shared-prompt rows (each prompt once per row that holds it)
    allowed       [R, 1, S, S]  shared-prompt rows only: query i may attend to key j (None:
                          the model finds the sequences from the restarting positions)
    source        [R*S]   flat index into the padded [B*T] ids of each packed token (filler:
                          any real token's), to lay per-token records (routed experts) out alike
    real          [R*S]   bool: the packed token is a sequence's, not filler
    """

    input_ids: Tensor
    position_ids: Tensor
    predictor: Tensor
    target: Tensor
    out: Tensor
    lengths: list[int]
    placed: int
    allowed: Tensor | None = None
    source: Tensor | None = None
    real: Tensor | None = None

    @property
    def filler(self) -> int:
        """Computed tokens that are no sequence's (the rows' tails)."""
        return self.computed_tokens - self.placed

    @property
    def computed_tokens(self) -> int:
        """Tokens pushed through the model, filler included (R x S)."""
        return self.input_ids.numel()

    def scatter(self, values: Tensor, B: int, Tr: int) -> Tensor:
        """[M] per response token -> [B, Tr] (zeros on padding), differentiable."""
        return values.new_zeros(B * Tr).index_copy(0, self.out, values).view(B, Tr)


def packed_rows(input_ids: Tensor, attention_mask: Tensor, num_response_tokens: int,
                row_tokens: int | None = None) -> PackedRows | None:
    """The packed layout of padded rows, or None when packing would not be exact.

    input_ids, attention_mask [B, T]; the last ``num_response_tokens`` columns are the
    response. Exact when each row's real tokens are one contiguous run (a left-padded prompt
    followed by a right-padded response, as every rollout is) and every row has a prompt
    token, so each response token has a real predecessor. ``row_tokens`` None: the longest
    sequence's length.
    """
    B, T = input_ids.shape
    Tr = num_response_tokens
    mask = attention_mask.bool()
    runs = _real_runs(mask, Tr)
    if runs is None:
        return None
    firsts, ns = runs
    lengths = [x - 1 for x in ns]  # the last token of a sequence predicts nothing: not fed
    bins = pack(lengths, max(row_tokens or max(lengths), 1))
    loads = [sum(lengths[b] for b in rows) for rows in bins]
    S = max(max(loads), 1)
    R = len(bins)
    dev = input_ids.device
    src: list[int] = []  # per token of the packed [R*S], in order: its index in the padded [B*T]
    positions: list[int] = []
    pred: list[int] = []  # per real response token: its predictor, target and output index
    tgt: list[int] = []
    out: list[int] = []
    c0 = T - Tr  # the first response column
    for r, rows in enumerate(bins):
        offset = r * S
        for b in rows:
            nb, fb = lengths[b], firsts[b]
            src.extend(range(b * T + fb, b * T + fb + nb))
            positions.extend(range(nb))
            # response columns c in [T - Tr, fb + nb]: the state at column c - 1 predicts token c
            k = fb + nb + 1 - c0  # real response tokens of row b
            if k > 0:
                pred.extend(range(offset + c0 - 1 - fb, offset + c0 - 1 - fb + k))
                tgt.extend(range(b * T + c0, b * T + c0 + k))
                out.extend(range(b * Tr, b * Tr + k))
            offset += nb
        fill = (r + 1) * S - offset  # filler: one more "sequence" starting at position 0
        src.extend([src[0]] * fill)  # any real token's id: the filler's states are never read
        positions.extend(range(fill))
    src_t, pos_t, *idx = _long_tensors(dev, src, positions, pred, tgt, out)
    real = (torch.arange(S) < torch.tensor(loads)[:, None]).to(dev)  # [R, S] a sequence's token, not filler
    return PackedRows(input_ids.reshape(-1)[src_t].view(R, S), pos_t.view(R, S), *idx, lengths, sum(lengths),
                      source=src_t, real=real.view(-1))


def _long_tensors(device: torch.device, *lists: list[int]) -> list[Tensor]:
    """The lists as long tensors on ``device``, moved there in one copy (a layout's indices:
    one host-to-device transfer per forward instead of one per index)."""
    flat = torch.tensor([x for xs in lists for x in xs], dtype=torch.long)
    return list(flat.to(device).split([len(xs) for xs in lists]))


def packed_layout(body: nn.Module, input_ids: Tensor, attention_mask: Tensor, num_response_tokens: int,
                  row_tokens: int | None = None, group_size: int | None = None,
                  fewer_than: int | None = None) -> PackedRows | None:
    """The packed rows of a forward of the transformer ``body``: shared-prompt rows when the rows
    share prompts by ``group_size`` and that pushes fewer tokens, else plain rows; None when
    neither is exact here or taken by the model. With ``fewer_than`` (the tokens another layout
    pushes), also None -- before any layout is built -- when no packed layout can push fewer:
    :func:`least_packed_tokens` is at least that."""
    # both one-off checks at the first packed forward, whatever its rows: each runs forwards
    # of its own, which the ranks of an FSDP group must all run, in the same order
    plain_ok, tree_ok = packing_supported(body), shared_packing_supported(body)
    if fewer_than is not None and least_packed_tokens(input_ids, attention_mask, num_response_tokens,
                                                      row_tokens, group_size if tree_ok else None) >= fewer_than:
        return None
    rows = packed_rows(input_ids, attention_mask, num_response_tokens, row_tokens)
    if rows is None:
        return None
    if tree_ok:
        shared = shared_packed_rows(input_ids, attention_mask, num_response_tokens, group_size, row_tokens,
                                    fewer_than=rows.computed_tokens)
        if shared is not None:
            return shared  # (its own mask: taken also by a model that ignores restarting positions)
    return rows if plain_ok else None


def least_packed_tokens(input_ids: Tensor, attention_mask: Tensor, num_response_tokens: int,
                        row_tokens: int | None = None, group_size: int | None = None) -> float:
    """A lower bound on the tokens any packed layout of these rows computes (:func:`packed_rows`,
    and :func:`shared_packed_rows` when ``group_size`` is given), from the real-token counts
    alone: no layout is built. inf when neither layout is exact here.

    Plain rows place every sequence whole: at least sum_b (n_b - 1). Shared-prompt rows place
    each response's k_b - 1 fed tokens and, in every row holding a group g, its prompt of p_g
    tokens once; a row holding two or more responses holds at most ``cap`` tokens (the row
    limit, :func:`_shared_bins`), a row holding one holds that response, so a row carries at most
    U_g = max(cap - p_g, the longest of g's fed responses) of g's response tokens and g's F_g
    fed tokens need at least ceil(F_g / U_g) rows (1 if all are empty): at least
    sum_g (F_g + rows_g x p_g). Filler only adds to either."""
    B, T = input_ids.shape
    Tr = num_response_tokens
    # read on the host: the rows of a GPU forward come over once, not a sync per question
    attention_mask = attention_mask.cpu()
    real = _real_runs(attention_mask.bool(), Tr)
    if real is None:
        return math.inf
    firsts, ns = real
    least = float(sum(ns) - B)
    if group_size is None or not same_prompts(input_ids.cpu(), attention_mask, Tr, group_size):
        return least
    G, Tp = int(group_size), T - Tr
    cap = max(row_tokens or max(x - 1 for x in ns), 1)
    shared = 0
    for g in range(B // G):
        p = Tp - firsts[g * G]
        fed = [ns[b] - p - 1 for b in range(g * G, (g + 1) * G) if ns[b] - p > 0]
        if not fed:
            continue
        most = max(cap - p, max(fed))
        shared += sum(fed) + p * (max(1, math.ceil(sum(fed) / most)) if most > 0 else 1)
    return min(least, float(shared))


def _real_runs(mask: Tensor, num_response_tokens: int) -> tuple[list[int], list[int]] | None:
    """(first real column, real tokens) of each row of ``mask`` [B, T], or None unless each row's
    real tokens are one run that starts before the response columns."""
    mask = mask.cpu()  # one copy from a GPU, then every question below is answered on the host
    T = mask.shape[1]
    n = mask.long().sum(1)  # [B] real tokens
    first = mask.long().argmax(1)  # [B] first real column
    last = torch.where(mask, torch.arange(T, device=mask.device), -1).amax(1)  # [B] last real column
    if bool((n == 0).any()) or bool((last - first + 1 != n).any()) or \
            bool((first >= T - num_response_tokens).any()):
        return None
    return first.tolist(), n.tolist()


def packed_hidden(body: nn.Module, rows: PackedRows, routing: Tensor | None = None,
                  model: nn.Module | None = None) -> Tensor:
    """States [M, H] predicting each real response token, from one packed forward of the
    transformer ``body`` (``models.loading.backbone`` of a causal LM). ``routing`` [B*T, Y, K]:
    the padded rows' recorded experts, laid out as the packed tokens for ``model``'s routers
    (models/moe.py)."""
    mask = None if rows.allowed is None else _attention_mask(body, rows.allowed)
    assert rows.source is not None and rows.real is not None
    with moe.feeding(model if model is not None else body,
                     None if routing is None else routing.index_select(0, rows.source.to(routing.device)), rows.real):
        out = body(input_ids=rows.input_ids, position_ids=rows.position_ids,
                   attention_mask=mask, use_cache=False)
    h = out.last_hidden_state  # [R, S, H]
    return h.reshape(-1, h.shape[-1]).index_select(0, rows.predictor)  # [M, H]


# ----------------------------------------------------------------------------- shared prompts

def same_prompts(input_ids: Tensor, attention_mask: Tensor, num_response_tokens: int,
                 group_size: int | None) -> bool:
    """Whether the rows come in groups of ``group_size`` (at least 2) whose prompts -- the
    columns before the last ``num_response_tokens`` -- are identical, ids and mask."""
    B, T = input_ids.shape
    G = group_size
    if G is None or G < 2 or B % G:
        return False
    Tp = T - num_response_tokens
    prompt = torch.cat([input_ids[:, :Tp], attention_mask[:, :Tp].to(input_ids.dtype)], dim=1)
    prompt = prompt.view(B // G, G, 2 * Tp)  # [P, G, 2*Tp] ids and mask of each group's rows
    return bool((prompt == prompt[:, :1]).all())


def shared_packed_rows(input_ids: Tensor, attention_mask: Tensor, num_response_tokens: int,
                       group_size: int | None, row_tokens: int | None = None,
                       fewer_than: int | None = None) -> PackedRows | None:
    """The packed layout with each group's prompt once per row that holds the group (module
    docstring), or None when it would not be exact: rows not in groups of identical prompts,
    or a row whose real tokens are not one run starting in the prompt; also None, before any
    tensor is built, when it would compute ``fewer_than`` tokens or more.

    Each response b of a group with a prompt of p real tokens and k_b real response tokens
    feeds k_b - 1 tokens (its first token is predicted by the prompt's last state, its last
    predicts nothing). Responses are assigned to rows of at most ``row_tokens`` tokens (None:
    the longest sequence's length, as for the plain layout) by :func:`_shared_bins`; in a row,
    each group's prompt comes first, then its responses.
    """
    if not same_prompts(input_ids, attention_mask, num_response_tokens, group_size):
        return None
    B, T = input_ids.shape
    Tr, G = num_response_tokens, int(group_size)  # type: ignore[arg-type]
    Tp = T - Tr
    mask = attention_mask.bool()
    real = _real_runs(mask, Tr)
    if real is None:
        return None
    firsts, ns = real
    prompt_len = [Tp - f for f in firsts]  # [B] real prompt tokens (equal within a group)
    k = [ns[b] - prompt_len[b] for b in range(B)]  # [B] real response tokens
    cap = max(row_tokens or max(x - 1 for x in ns), 1)
    rows, loads = _shared_bins([b for b in range(B) if k[b] > 0], [x - 1 for x in k], prompt_len, G, cap)
    if not rows:
        return None
    S, R = max(max(loads), 1), len(rows)
    if fewer_than is not None and R * S >= fewer_than:
        return None
    # per token of the packed [R*S], in order: where its id comes from, its position
    src: list[int] = []
    pos: list[int] = []
    runs: list[tuple[int, int, int, int, int]] = []  # causal runs: row, start, length, its prompt (start, end)
    pred: list[int] = []  # per real response token: its predictor, target and output index
    tgt: list[int] = []
    out: list[int] = []
    filler = 0
    filled: list[bool] = []
    for r, held in enumerate(rows):
        offset = 0
        for g in sorted(held):
            b0 = held[g][0]
            p = prompt_len[b0]
            src.extend(range(b0 * T + firsts[b0], b0 * T + Tp))  # the prompt, once
            pos.extend(range(p))
            runs.append((r, offset, p, offset, offset))
            last_prompt, seg_start = len(src) - 1, offset
            offset += p
            for b in sorted(held[g]):
                fed = k[b] - 1
                src.extend(range(b * T + Tp, b * T + Tp + fed))  # response b: tokens 0 .. k_b - 2
                pos.extend(range(p, p + fed))
                runs.append((r, offset, fed, seg_start, seg_start + p))
                pred.append(last_prompt)
                pred.extend(range(len(src) - fed, len(src)))
                tgt.extend(range(b * T + Tp, b * T + Tp + k[b]))
                out.extend(range(b * Tr, b * Tr + k[b]))
                offset += fed
        fill = S - offset  # filler: a causal run of its own
        filled.extend([False] * offset + [True] * fill)
        src.extend([src[0]] * fill)  # any real token's id: the filler's states are never read
        pos.extend(range(fill))
        runs.append((r, offset, fill, offset, offset))
        filler += fill
    dev = input_ids.device
    queries = _tree_queries(runs, R, S)
    src_t, pos_t, *idx, q = _long_tensors(dev, src, pos, pred, tgt, out, queries or [])
    return PackedRows(input_ids.reshape(-1)[src_t].view(R, S), pos_t.view(R, S), *idx,
                      [x - 1 for x in ns], R * S - filler, _tree_mask(runs, R, S, dev, q if queries else None),
                      source=src_t, real=~torch.tensor(filled, dtype=torch.bool, device=dev))


Bins = tuple[list[dict[int, list[int]]], list[int]]  # per row: group -> its responses there; its tokens


def _shared_bins(units: list[int], fed: list[int], prompt_len: list[int], G: int, cap: int) -> Bins:
    """Responses ``units`` into rows of at most ``cap`` tokens (a row of one response may exceed
    it), each row holding each of its groups' prompts once: two assignments, the one computing
    fewer tokens (rows x the fullest row) kept -- :func:`_filled_bins` shares prompts the most,
    :func:`_balanced_bins` evens the rows out (less filler)."""
    tries = [_filled_bins(units, fed, prompt_len, G, cap), _balanced_bins(units, fed, prompt_len, G, cap)]
    return min(tries, key=lambda t: len(t[1]) * max(t[1], default=0))


def _filled_bins(units: list[int], fed: list[int], prompt_len: list[int], G: int, cap: int) -> Bins:
    """Largest response first, into the lightest row holding its group's prompt where it fits
    (adding ``fed`` tokens), else the lightest row with room for prompt and response, else a
    new row."""
    rows: list[dict[int, list[int]]] = []
    loads: list[int] = []
    of_group: dict[int, list[int]] = {}  # group -> the rows holding its prompt
    lightest: list[tuple[int, int]] = []  # heap of (load, row); stale entries skipped
    for b in sorted(units, key=lambda b: (-fed[b], b)):
        g = b // G
        fits = [r for r in of_group.get(g, ()) if loads[r] + fed[b] <= cap]
        if fits:
            r = min(fits, key=lambda r: (loads[r], r))
            loads[r] += fed[b]
        else:
            while lightest and lightest[0][0] != loads[lightest[0][1]]:
                heapq.heappop(lightest)
            if lightest and lightest[0][0] + prompt_len[b] + fed[b] <= cap:
                r = lightest[0][1]
            else:
                r = len(rows)
                rows.append({})
                loads.append(0)
            loads[r] += prompt_len[b] + fed[b]
            of_group.setdefault(g, []).append(r)
        rows[r].setdefault(g, []).append(b)
        heapq.heappush(lightest, (loads[r], r))
    return rows, loads


def _balanced_bins(units: list[int], fed: list[int], prompt_len: list[int], G: int, cap: int) -> Bins:
    """For k rows: largest response first, each into the row whose load after it is the least
    (``microbatch.pack``'s balanced assignment, a row holding the group's prompt adding ``fed``
    tokens, any other the prompt too). k starts at the tokens with each prompt once over ``cap``
    and grows (at least to the last try's tokens over ``cap``) until no row of two or more
    responses exceeds ``cap``; :class:`_BalancedTries` runs the tries without repeating the
    work they share."""
    order = sorted(units, key=lambda b: (-fed[b], b))
    first = {b // G: b for b in units}
    k = max(1, math.ceil((sum(fed[b] for b in units) + sum(prompt_len[b] for b in first.values())) / cap))
    tries = _BalancedTries(order, fed, prompt_len, G, cap)
    while True:
        placed = tries.place(k, final=k >= len(units))
        if isinstance(placed, int):
            k = placed
            continue
        row_of, loads = placed
        rows: list[dict[int, list[int]]] = [{} for _ in range(k)]
        for b, r in zip(order, row_of):
            rows[r].setdefault(b // G, []).append(b)
        kept = [i for i in range(k) if rows[i]]
        return [rows[i] for i in kept], [loads[i] for i in kept]


class _BalancedTries:
    """:func:`_balanced_bins`'s tries, each placing the same responses into k rows, at the cost
    of what differs between them (this planner runs on every batch of a shared-prompt forward;
    repeating every try in full made a batch of 100 x 4 short answers cost ~0.1-0.3 s).

    - The start is shared: while a try has an empty row, the lightest row is an empty one (load
      0), so its placements are those of a run with as many rows as it asks for (computed once
      here) until that run opens row k; a try goes on from there.
    - A failing try stops early: once a row of two or more responses exceeds ``cap`` (rows only
      grow), the next k only needs the try's total tokens over ``cap``, and the responses still
      to place add at least their ``fed`` tokens and at most their prompt's too; the try stops as
      soon as both bounds give the same next k."""

    def __init__(self, order: list[int], fed: list[int], prompt_len: list[int], G: int, cap: int):
        self.order, self.fed, self.prompt_len, self.G, self.cap = order, fed, prompt_len, G, cap
        self.most = list(itertools.accumulate(reversed([prompt_len[b] + fed[b] for b in order]), initial=0))[::-1]
        self.least = list(itertools.accumulate(reversed([fed[b] for b in order]), initial=0))[::-1]
        self.row_of: list[int] = []  # the unbounded run: per response (in order) its row
        self.adds: list[int] = []  # the tokens it added there
        self.opens: list[int] = []  # row j opened by response order[opens[j]]
        self.joins: dict[int, list[tuple[int, int]]] = {}  # group -> (response, row) its prompt joined
        self.start = _Start()
        loads: list[int] = []
        lightest: list[tuple[int, int]] = []
        for i, b in enumerate(order):
            while lightest and lightest[0][0] != loads[lightest[0][1]]:
                heapq.heappop(lightest)
            r = lightest[0][1] if lightest and lightest[0][0] == 0 else len(loads)  # an empty row
            r, add, joins = self._choose(r, loads[r] if r < len(loads) else 0, b, loads,
                                         [r for _, r in self.joins.get(b // G, ())])
            if joins:
                self.joins.setdefault(b // G, []).append((i, r))
            if r == len(loads):
                self.opens.append(i)
                loads.append(0)
            self.row_of.append(r)
            self.adds.append(add)
            loads[r] += add
            heapq.heappush(lightest, (loads[r], r))

    def _choose(self, r: int, load: int, b: int, loads: list[int], held: list[int]) -> tuple[int, int, bool]:
        """Response b's row, the tokens it adds and whether its prompt joins that row: the
        lightest row ``r`` (``load``) with its prompt, or the lightest row ``held`` holding its
        prompt when that adds no more."""
        if not held:
            return r, self.prompt_len[b] + self.fed[b], True
        h = held[0] if len(held) == 1 else min(held, key=lambda r: (loads[r], r))
        if loads[h] + self.fed[b] <= load + self.prompt_len[b] + self.fed[b]:
            return h, self.fed[b], False
        return r, self.prompt_len[b] + self.fed[b], True

    def place(self, k: int, final: bool) -> tuple[list[int], list[int]] | int:
        """The try of k rows: per response its row and per row its tokens, when no row of two or
        more responses exceeds ``cap`` (or ``final``), else the next try's k. Tries come with k
        growing: the shared start is extended, not recomputed."""
        t = self.opens[k] if k < len(self.opens) else len(self.order)
        start = self.start
        for i in range(start.t, t):
            r = self.row_of[i]
            if r == len(start.loads):
                start.loads.append(0)
                start.counts.append(0)
            start.loads[r] += self.adds[i]
            start.counts[r] += 1
            start.over = start.over or (start.loads[r] > self.cap and start.counts[r] > 1)
        start.t = t
        pad = k - len(start.loads)
        loads, counts, row_of = start.loads + [0] * pad, start.counts + [0] * pad, self.row_of[:t]
        over = start.over and not final
        total = sum(loads)
        joined: dict[int, list[int]] = {}
        lightest = [(load, r) for r, load in enumerate(loads)]
        heapq.heapify(lightest)
        for i in range(t, len(self.order)):
            if over:
                low = math.ceil((total + self.least[i]) / self.cap)
                if max(k + 1, low) == max(k + 1, math.ceil((total + self.most[i]) / self.cap)):
                    return max(k + 1, low)
            b = self.order[i]
            g = b // self.G
            if g not in joined:
                joined[g] = [r for j, r in self.joins.get(g, ()) if j < t]
            while lightest[0][0] != loads[lightest[0][1]]:
                heapq.heappop(lightest)
            r, add, joins = self._choose(lightest[0][1], lightest[0][0], b, loads, joined[g])
            if joins:
                joined[g].append(r)
            row_of.append(r)
            loads[r] += add
            counts[r] += 1
            total += add
            over = over or (not final and loads[r] > self.cap and counts[r] > 1)
            heapq.heappush(lightest, (loads[r], r))
        return max(k + 1, math.ceil(total / self.cap)) if over else (row_of, loads)


@dataclass
class _Start:
    """The start the tries of :class:`_BalancedTries` share, up to response ``t``: per row its
    tokens and responses, and whether a row of two or more responses already exceeds the cap."""
    t: int = 0
    loads: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    over: bool = False


def _tree_queries(runs: list[tuple[int, int, int, int, int]], R: int, S: int) -> list[int] | None:
    """Per query of the [R, S] rows: its run's start, its prompt's start and end, flattened
    [3 * R * S] (what :func:`_tree_mask` compares whole); None for a mask it writes by blocks."""
    if R * S * S > _WHOLE_MASK_ELEMENTS:
        return None
    own, p0, p1 = [0] * (R * S), [0] * (R * S), [0] * (R * S)
    for r, a, n, start, end in runs:
        at = r * S + a
        own[at:at + n], p0[at:at + n], p1[at:at + n] = [a] * n, [start] * n, [end] * n
    return own + p0 + p1


def _tree_mask(runs: list[tuple[int, int, int, int, int]], R: int, S: int, device: torch.device,
               queries: Tensor | None = None) -> Tensor:
    """[R, 1, S, S] (True: attend). Each run (row, start, n, prompt start, prompt end) is n
    tokens attending causally among themselves and to every token of their prompt (an empty
    range for a prompt itself or filler). Small masks are computed in a few whole-tensor
    comparisons (``queries``: :func:`_tree_queries` as a tensor on ``device``, when already
    moved there); large ones written block by block, touching only the allowed entries."""
    if R * S * S > _WHOLE_MASK_ELEMENTS:
        allowed = torch.zeros(R, S, S, dtype=torch.bool, device=device)
        tri = torch.ones(S, S, dtype=torch.bool, device=device).tril()
        for r, a, n, p0, p1 in runs:
            allowed[r, a:a + n, a:a + n] = tri[:n, :n]
            allowed[r, a:a + n, p0:p1] = True
        return allowed[:, None]
    if queries is None:
        queries = _long_tensors(device, _tree_queries(runs, R, S) or [])[0]
    q = queries.view(3, R, S, 1)
    k = torch.arange(S, device=device)
    allowed = (k >= q[0]) | ((k >= q[1]) & (k < q[2]))  # [R, S(q), S(k)]
    return (allowed & torch.ones(S, S, dtype=torch.bool, device=device).tril())[:, None]


#: above this many entries _tree_mask writes blocks instead of comparing whole tensors
_WHOLE_MASK_ELEMENTS = 1 << 22


def _attention_mask(body: nn.Module, allowed: Tensor) -> Tensor:
    """The 4D mask the body's attention takes: boolean (True: attend) for sdpa, additive
    (0 or the dtype's lowest) for eager."""
    if _attention_kind(body) == "sdpa":
        return allowed
    dtype = next(body.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def _attention_kind(body: nn.Module) -> str | None:
    return getattr(getattr(body, "config", None), "_attn_implementation", None)


# ----------------------------------------------------------------------------- support check

_CHECKED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def packing_supported(body: nn.Module) -> bool:
    """Whether the transformer ``body`` keeps packed sequences apart, checked once per module.

    Two short sequences run packed in one row and each on its own (no gradient, dropout off,
    autocast off): their states must agree. A model that fails is warned about once (each
    model, so each run, says it) and runs padded.
    """
    known = _CHECKED.get(body)
    if known is not None:
        return known
    ok = _states_agree(body)
    _CHECKED[body] = ok
    name = type(body).__name__
    if not ok:  # once per model: the check is cached above
        warnings.warn(f"train.packing: {name} does not keep packed sequences apart (its attention or "
                      "positions ignore restarting position ids); its forwards run padded (shared-prompt "
                      "rows excepted: they carry their own mask)", stacklevel=3)
    return ok


def _states_agree(body: nn.Module) -> bool:
    def build(run, tokens, arange):  # two sequences, packed in one row and each on its own
        a, b = tokens(7, 5, 3), tokens(5, 7, 11)
        ref = torch.cat([run(a, arange(7)), run(b, arange(5))])
        return ref, run(torch.cat([a, b]), torch.cat([arange(7), arange(5)]))
    return _forwards_agree(body, build)


def _forwards_agree(body: nn.Module, build) -> bool:
    """``build(run, tokens, arange)`` -> (reference states, packed states) from forwards of the
    body (``run(ids, positions, mask=None)``: one row, eval mode, no gradient, autocast off;
    ``tokens(n, step, start)``: n distinct ids); True when the packed ones are finite and agree."""
    param = next(body.parameters())
    dev = param.device
    vocab = int(getattr(body.config, "vocab_size", 8) or 8)

    def tokens(n: int, step: int, start: int) -> Tensor:
        return (torch.arange(n, device=dev) * step + start) % vocab

    def arange(n: int) -> Tensor:
        return torch.arange(n, device=dev)

    def run(ids: Tensor, pos: Tensor, mask: Tensor | None = None) -> Tensor:
        return body(input_ids=ids[None], position_ids=pos[None], attention_mask=mask,
                    use_cache=False).last_hidden_state[0].float()

    was = body.training
    body.eval()
    try:
        with torch.no_grad(), torch.autocast(device_type=dev.type, enabled=False):
            ref, packed = build(run, tokens, arange)
    finally:
        body.train(was)
    tol = (1e-4 if param.dtype == torch.float32 else 5e-2) * (1.0 + float(ref.abs().max()))
    return bool(torch.isfinite(packed).all()) and float((packed - ref).abs().max()) <= tol


_TREE_CHECKED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def shared_packing_supported(body: nn.Module) -> bool:
    """Whether the transformer ``body`` takes shared-prompt rows exactly, checked once per
    module: its attention is sdpa or eager (a custom 4D mask), every layer attends over the
    whole context, and a prompt with two responses in one row gives each response's states as
    its own forward does. No warning when not: the plain packed layout is then taken."""
    known = _TREE_CHECKED.get(body)
    if known is not None:
        return known
    ok = _attention_kind(body) in ("sdpa", "eager") and plain_kv_cache(body) and _tree_agrees(body)
    _TREE_CHECKED[body] = ok
    return ok


def _tree_agrees(body: nn.Module) -> bool:
    def build(run, tokens, arange):  # a prompt and two responses: in one row, and each on its own
        prompt, one, two = tokens(5, 5, 3), tokens(4, 7, 11), tokens(3, 3, 2)
        ref = torch.cat([run(torch.cat([prompt, one]), arange(9)), run(torch.cat([prompt, two]), arange(8))[5:]])
        allowed = _tree_mask([(0, 0, 5, 0, 0), (0, 5, 4, 0, 5), (0, 9, 3, 0, 5)], 1, 12, prompt.device)
        return ref, run(torch.cat([prompt, one, two]), torch.cat([arange(9), 5 + arange(3)]),
                        _attention_mask(body, allowed))
    try:
        return _forwards_agree(body, build)
    except (RuntimeError, ValueError, TypeError):  # an attention that refuses a 4D mask
        return False
