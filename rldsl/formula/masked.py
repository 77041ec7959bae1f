"""The masked reductions formulas compile to (``fx.*`` in generated code), and ``spread``.

Every reduction reads only valid entries: tokens where ``mask > 0``, rows where ``rows`` is
true (in ``advantages()`` the rows whose reward is real; in ``loss()`` the rows with at
least one token). Padding may hold anything (even inf): it is selected away with
``torch.where`` before any arithmetic. Conventions, the same in every scope:

- an empty reduction gives 0 (sum, mean, max, min, quantile) and std 1;
- std is Bessel's (N - 1), and 1 with fewer than two entries (verl's singleton rule);
- a constant argument is spread over the entries first, so ``seq_sum(1)`` is L and
  ``group_sum(1)`` the number of valid members of the group;
- a quantile level may be an expression (a 0-dim tensor): it is clamped to [0, 1] and carries
  no gradient.

The order operations (sort, rank, cumsum, topk_mask; below) keep their argument's shape and
give 0 (false) on padding; ties are broken by position, as a stable sort.

``rows`` and ``valid`` are float 0/1 tensors of the stage's dtype: they also give constants
their dtype and device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_torch import torch
from ..ops import group_view

if TYPE_CHECKING:
    from torch import Tensor


def _as(x: Tensor | float | bool, like: Tensor) -> Tensor:
    """``x`` as a tensor of ``like``'s dtype and device (no copy when it already is one)."""
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


def spread(x: Tensor | float | bool, like: Tensor) -> Tensor:
    """Broadcast [] or [B] (or [B, T]) to ``like``'s shape ([B] or [B, T]), as ``like``'s dtype."""
    x = _as(x, like)
    if x.dim() == 1 and like.dim() == 2:
        x = x.unsqueeze(-1)
    return x.expand_as(like)


def size(mask: Tensor, dim: int) -> Tensor:
    """B (dim 0) or T (dim 1) as a 0-dim tensor of the mask's dtype, by a sum: torch.compile keeps
    the size symbolic (a tensor made from the int would fix it in the compiled code)."""
    return mask.new_ones(mask.shape[dim]).sum()


def scalar(x: float | int, like: Tensor) -> Tensor:
    """A number (G, B, T, or a constant branch of ``where``) as a 0-dim tensor of ``like``'s dtype."""
    return _as(x, like)


def _moments(x: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and Bessel std over the last dim of ``x`` at ``v`` (keepdim); std 1 below 2 entries."""
    k = v.to(x.dtype).sum(-1, keepdim=True)
    zero = torch.zeros_like(x)
    mean = torch.where(v, x, zero).sum(-1, keepdim=True) / k.clamp_min(1)
    ss = torch.where(v, (x - mean) ** 2, zero).sum(-1, keepdim=True)
    var = torch.where(k > 1, ss / (k - 1).clamp_min(1), torch.ones_like(ss))  # no sqrt(0) when k < 2
    return mean, torch.sqrt(var)


def _level(q: Tensor | float, x: Tensor) -> Tensor | float:
    """A quantile level: a checked constant as is; an expression (of G, B, T, parameters, ...) as a
    0-dim tensor of ``x``'s dtype clamped to [0, 1], without gradient."""
    if isinstance(q, (int, float)):
        return float(q)
    return q.detach().to(x.dtype).clamp(0.0, 1.0)


def _reduce(x: Tensor, v: Tensor, how: str, q: Tensor | float = 0.5) -> Tensor:
    """Reduce the last dim of ``x`` over the entries where ``v`` (bool) holds (keepdim)."""
    x = torch.where(v, x, torch.zeros_like(x))  # first: inf / NaN padding reaches no value or gradient
    if how == "sum":
        return torch.where(v, x, torch.zeros_like(x)).sum(-1, keepdim=True)
    if how in ("mean", "std"):
        mean, std = _moments(x, v)
        return mean if how == "mean" else std
    has = v.any(-1, keepdim=True)
    if how == "max":
        m = torch.where(v, x, torch.full_like(x, -torch.inf)).amax(-1, keepdim=True)
    elif how == "min":
        m = torch.where(v, x, torch.full_like(x, torch.inf)).amin(-1, keepdim=True)
    else:  # quantile, linear interpolation (torch.quantile's default)
        m = torch.where(v, x, torch.full_like(x, torch.nan)).nanquantile(_level(q, x), dim=-1, keepdim=True)
    return torch.where(has, m, torch.zeros_like(m))


def _seq(x: Tensor | float, mask: Tensor, how: str, q: Tensor | float = 0.5) -> Tensor:
    """Over each row's tokens: -> [B]."""
    x = _as(x, mask)
    if x.dim() == 1:
        x = x.unsqueeze(-1)
    return _reduce(x.expand_as(mask), mask > 0, how, q).squeeze(-1)


def _members(x: Tensor | float, rows: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
    """``group_by=FIELD``: row i's group is every row j with keys_j = keys_i. Returns x [B] as a
    [B, B] view whose row i holds every x_j, and [B, B] "j is a valid member of i's group"."""
    x = _as(x, rows).expand_as(rows)
    B = x.shape[0]
    same = keys.reshape(-1, 1) == keys.reshape(1, -1)
    return x.reshape(1, B).expand(B, B), same & (rows > 0).reshape(1, B)


def _group(x: Tensor | float, rows: Tensor, G: int | Tensor, how: str, q: Tensor | float = 0.5) -> Tensor:
    """Over each group's valid rows: [B] -> [B] (every member gets its group's value). ``G``: the
    group size (a prompt's samples: consecutive rows), or [B] keys (``group_by``: equal keys)."""
    if torch.is_tensor(G):  # [B] keys
        xs, members = _members(x, rows, G)  # [B, B]
        return _reduce(xs, members, how, q).reshape(-1)
    g = group_view(_as(x, rows).expand_as(rows), G)  # [P, G]
    out = _reduce(g, group_view(rows > 0, G), how, q)  # [P, 1]
    return out.expand_as(g).reshape(-1)


def _batch(x: Tensor | float, valid: Tensor, how: str, q: Tensor | float = 0.5) -> Tensor:
    """Over the batch's valid entries (``valid``: rows [B] or the token mask [B, T]): -> []."""
    x = _as(x, valid)
    if x.dim() == 1 and valid.dim() == 2:
        x = x.unsqueeze(-1)
    return _reduce(x.expand_as(valid).reshape(-1), valid.reshape(-1) > 0, how, q).reshape(())


# The reductions of the formula language (lang.FUNCTIONS): scope_reduction(x[, q], valid ...).

def seq_sum(x: Tensor | float, mask: Tensor) -> Tensor:
    return _seq(x, mask, "sum")


def seq_mean(x: Tensor | float, mask: Tensor) -> Tensor:
    return _seq(x, mask, "mean")


def seq_std(x: Tensor | float, mask: Tensor) -> Tensor:
    return _seq(x, mask, "std")


def seq_max(x: Tensor | float, mask: Tensor) -> Tensor:
    return _seq(x, mask, "max")


def seq_min(x: Tensor | float, mask: Tensor) -> Tensor:
    return _seq(x, mask, "min")


def seq_quantile(x: Tensor | float, q: Tensor | float, mask: Tensor) -> Tensor:
    return _seq(x, mask, "quantile", q)


def group_sum(x: Tensor | float, rows: Tensor, G: int | Tensor) -> Tensor:
    return _group(x, rows, G, "sum")


def group_mean(x: Tensor | float, rows: Tensor, G: int | Tensor) -> Tensor:
    return _group(x, rows, G, "mean")


def group_std(x: Tensor | float, rows: Tensor, G: int | Tensor) -> Tensor:
    return _group(x, rows, G, "std")


def group_max(x: Tensor | float, rows: Tensor, G: int | Tensor) -> Tensor:
    return _group(x, rows, G, "max")


def group_min(x: Tensor | float, rows: Tensor, G: int | Tensor) -> Tensor:
    return _group(x, rows, G, "min")


def group_quantile(x: Tensor | float, q: Tensor | float, rows: Tensor, G: int | Tensor) -> Tensor:
    return _group(x, rows, G, "quantile", q)


def batch_sum(x: Tensor | float, valid: Tensor) -> Tensor:
    return _batch(x, valid, "sum")


def batch_mean(x: Tensor | float, valid: Tensor) -> Tensor:
    return _batch(x, valid, "mean")


def batch_std(x: Tensor | float, valid: Tensor) -> Tensor:
    return _batch(x, valid, "std")


def batch_max(x: Tensor | float, valid: Tensor) -> Tensor:
    return _batch(x, valid, "max")


def batch_min(x: Tensor | float, valid: Tensor) -> Tensor:
    return _batch(x, valid, "min")


def batch_quantile(x: Tensor | float, q: Tensor | float, valid: Tensor) -> Tensor:
    return _batch(x, valid, "quantile", q)


# ---------------------------------------------------------------------------------------
# Order operations: sort, rank, cumsum, topk_mask over the last dim at the valid entries.
#
# Entries are taken in position order (a sequence's tokens, a group's rows, the batch's rows or
# its tokens row by row). Padding never takes part and gets 0 (false for topk_mask). Ties are
# broken by position, as a stable sort does: of two equal values the earlier one ranks lower,
# and topk_mask (the largest k, i.e. rank(-x) < k) prefers the earlier one too.


def _permutation(key: Tensor, v: Tensor) -> Tensor:
    """The stable ascending order of ``key`` over the last dim with every valid entry before the
    padding: indices [..., N]. Two stable sorts (by value, then valid-first), so a valid inf never
    changes places with padding."""
    by_value = torch.sort(key.detach(), dim=-1, stable=True).indices
    pad = (~v).to(torch.int32).gather(-1, by_value)
    by_pad = torch.sort(pad, dim=-1, stable=True).indices
    return by_value.gather(-1, by_pad)


def _order(x: Tensor, v: Tensor, how: str, k: Tensor | float = 0.0) -> Tensor:
    """Order operation ``how`` over the last dim of ``x`` at the entries where ``v`` (bool) holds."""
    zero = torch.zeros_like(x)
    x = torch.where(v, x, zero)  # first: inf / NaN padding reaches no value or gradient
    if how == "cumsum":
        return torch.where(v, x.cumsum(-1), zero)
    idx = _permutation(-x if how == "topk_mask" else x, v)
    if how == "sort":  # the i-th valid entry (in position order) gets the i-th smallest value
        ordinal = (v.to(torch.int64).cumsum(-1) - 1).clamp_min(0)
        return torch.where(v, x.gather(-1, idx).gather(-1, ordinal), zero)
    rank = idx.argsort(dim=-1).to(x.dtype)  # the inverse permutation: valid entries rank 0..n-1
    if how == "rank":
        return torch.where(v, rank, zero)
    kk = k if isinstance(k, (int, float)) else k.detach().to(x.dtype)
    return v & (rank < kk)


def _seq_order(x: Tensor | float, mask: Tensor, how: str, k: Tensor | float = 0.0) -> Tensor:
    """Over each row's tokens: -> [B, T]."""
    x = _as(x, mask)
    if x.dim() == 1:
        x = x.unsqueeze(-1)
    return _order(x.expand_as(mask), mask > 0, how, k)


def _group_order(x: Tensor | float, rows: Tensor, G: int | Tensor, how: str, k: Tensor | float = 0.0) -> Tensor:
    """Over each group's valid rows: [B] -> [B]. ``G`` as in :func:`_group`; with keys, row i's
    value is the order operation over i's group (in row order), read at i."""
    if torch.is_tensor(G):  # [B] keys
        xs, members = _members(x, rows, G)  # [B, B]
        return _order(xs, members, how, k).diagonal()
    g = group_view(_as(x, rows).expand_as(rows), G)  # [P, G]
    return _order(g, group_view(rows > 0, G), how, k).reshape(-1)


def _batch_order(x: Tensor | float, valid: Tensor, how: str, k: Tensor | float = 0.0) -> Tensor:
    """Over the batch's valid entries (``valid``: rows [B] or the token mask [B, T], read row by
    row): -> ``valid``'s shape."""
    x = _as(x, valid)
    if x.dim() == 1 and valid.dim() == 2:
        x = x.unsqueeze(-1)
    return _order(x.expand_as(valid).reshape(-1), valid.reshape(-1) > 0, how, k).reshape(valid.shape)


# The order operations of the formula language (lang.ORDER): scope_operation(x[, k], valid ...).

def seq_sort(x: Tensor | float, mask: Tensor) -> Tensor:
    """out[b, t] = the i-th smallest of row b's valid x, where t is row b's i-th valid token."""
    return _seq_order(x, mask, "sort")


def seq_rank(x: Tensor | float, mask: Tensor) -> Tensor:
    """out[b, t] = #{valid s: x[b, s] < x[b, t], or x[b, s] = x[b, t] and s < t}."""
    return _seq_order(x, mask, "rank")


def seq_cumsum(x: Tensor | float, mask: Tensor) -> Tensor:
    """out[b, t] = sum over valid s <= t of x[b, s]."""
    return _seq_order(x, mask, "cumsum")


def seq_topk_mask(x: Tensor | float, k: Tensor | float, mask: Tensor) -> Tensor:
    """out[b, t] = valid and seq_rank(-x)[b, t] < k: the k largest of each row (earlier first on ties)."""
    return _seq_order(x, mask, "topk_mask", k)


def group_sort(x: Tensor | float, rows: Tensor, G: int | Tensor) -> Tensor:
    """out[i] = the j-th smallest of i's group's valid x, where i is the group's j-th valid row."""
    return _group_order(x, rows, G, "sort")


def group_rank(x: Tensor | float, rows: Tensor, G: int | Tensor) -> Tensor:
    """out[i] = #{valid j in i's group: x_j < x_i, or x_j = x_i and j < i}."""
    return _group_order(x, rows, G, "rank")


def group_cumsum(x: Tensor | float, rows: Tensor, G: int | Tensor) -> Tensor:
    """out[i] = sum over the valid rows j <= i of i's group of x_j."""
    return _group_order(x, rows, G, "cumsum")


def group_topk_mask(x: Tensor | float, k: Tensor | float, rows: Tensor, G: int | Tensor) -> Tensor:
    """out[i] = valid and group_rank(-x)[i] < k: the k largest of each group (earlier first on ties)."""
    return _group_order(x, rows, G, "topk_mask", k)


def batch_sort(x: Tensor | float, valid: Tensor) -> Tensor:
    """The batch's valid entries sorted ascending, the j-th smallest at the j-th valid entry (row by row)."""
    return _batch_order(x, valid, "sort")


def batch_rank(x: Tensor | float, valid: Tensor) -> Tensor:
    """#{valid j: x_j < x_i, or x_j = x_i and j before i (row by row)}, over the whole batch."""
    return _batch_order(x, valid, "rank")


def batch_cumsum(x: Tensor | float, valid: Tensor) -> Tensor:
    """The sum of x over the batch's valid entries up to and including i (row by row)."""
    return _batch_order(x, valid, "cumsum")


def batch_topk_mask(x: Tensor | float, k: Tensor | float, valid: Tensor) -> Tensor:
    """valid and batch_rank(-x) < k: the k largest entries of the batch (earlier first on ties)."""
    return _batch_order(x, valid, "topk_mask", k)


# The bounded searches of the formula language (lang.SEARCHES). ``cond`` is the condition the
# generated code writes as a lambda of the searched variable(s): it returns a 0-dim true/false
# tensor. Both run a fixed number of steps (a constant of the spec), so torch.compile unrolls
# them; the values found carry no gradient (a search decides, it does not differentiate).

def bisect(lo: Tensor | float, hi: Tensor | float, steps: int, cond, like: Tensor) -> Tensor:  # noqa: ANN001
    """Bisection on a scalar: a, b = lo, hi; ``steps`` times m = (a + b) / 2 (in ``like``'s dtype),
    then b = m where cond(m) holds, else a = m; the result is b.

    b is always hi or a midpoint where cond held, a is lo or one where it failed: for a condition
    false below a threshold x* and true from it on, x* <= b <= x* + (hi - lo) / 2^steps. hi when
    cond holds at no midpoint; lo + (hi - lo) / 2^steps when it holds at all of them."""
    a = _as(lo, like).detach()
    b = _as(hi, like).detach()
    for _ in range(steps):
        m = (a + b) / 2
        ok = cond(m)
        a, b = torch.where(ok, a, m), torch.where(ok, m, b)
    return b


def first_of(candidates: tuple, cond, like: Tensor) -> Tensor | tuple[Tensor, ...]:  # noqa: ANN001
    """The first candidate at which ``cond`` holds, the last when none does. A candidate is a
    number (cond takes it) or a tuple of numbers (cond takes them as its arguments; the result
    is a tuple). Every candidate's condition is computed (a fixed count), then
    out = where(ok_1, c_1, where(ok_2, c_2, ... c_n))."""
    pairs = [tuple(_as(x, like).detach() for x in (c if isinstance(c, tuple) else (c,))) for c in candidates]
    oks = [cond(*c) for c in pairs[:-1]]
    out = pairs[-1]
    for c, ok in zip(reversed(pairs[:-1]), reversed(oks)):
        out = tuple(torch.where(ok, x, y) for x, y in zip(c, out))
    return out if isinstance(candidates[0], tuple) else out[0]


# Reductions over the top-K axis of the policy's top-K inputs ([B, T, K] -> [B, T]). The K axis
# has no padding (every position has K candidates), so nothing is masked here; the token axis's
# padding stays where it was, for the seq_/batch_ reductions and the loss's mask to drop.

def k_sum(x: Tensor) -> Tensor:
    """out[b, t] = sum_k x[b, t, k]."""
    return x.sum(-1)


def k_mean(x: Tensor) -> Tensor:
    """out[b, t] = sum_k x[b, t, k] / K."""
    return x.mean(-1)


def k_max(x: Tensor) -> Tensor:
    """out[b, t] = max_k x[b, t, k] (its gradient goes to the largest, as torch.amax shares it on ties)."""
    return x.amax(-1)


def k_min(x: Tensor) -> Tensor:
    """out[b, t] = min_k x[b, t, k]."""
    return x.amin(-1)
