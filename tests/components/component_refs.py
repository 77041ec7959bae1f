"""Shared helpers for the component tests: tiny spec builder, batch makers and the plain-loop
aggregation reference. Nothing here calls an rldsl component; references are written from the
formulas of the papers and peers named in each component's ``source:`` (verl, TRL, ROLL) with
Python loops over lists.
"""
from __future__ import annotations

import math

import torch

import rldsl
from rldsl.ops import AdvantageBatch


def spec_fn(slots: str, name: str = "t", compile: bool = False) -> rldsl.CompiledAlgorithm:
    """An algorithm written only as a spec: ``slots`` holds one ``slot component(args)`` per line."""
    lines = [f"algorithm {name}", '  "written in a test"']
    lines += ["  " + s.strip() for s in slots.strip().splitlines() if s.strip()]
    return rldsl.compile(rldsl.loads("\n".join(lines) + "\n", filename=f"{name}.rl"), compile=compile)


def lists(x: torch.Tensor) -> list:
    return x.detach().double().tolist()


def adv_batch(rewards, group_size: int, mask=None, values=None, token_rewards=None,
              truncated=None, T: int = 3) -> AdvantageBatch:
    r = torch.as_tensor(rewards, dtype=torch.float32)
    m = torch.ones(r.shape[0], T) if mask is None else torch.as_tensor(mask, dtype=torch.float32)
    tr = torch.zeros_like(m) if token_rewards is None else torch.as_tensor(token_rewards, dtype=torch.float32)
    return AdvantageBatch(rewards=r, raw_rewards=r, token_rewards=tr, mask=m, group_size=group_size,
                          values=None if values is None else torch.as_tensor(values, dtype=torch.float32),
                          truncated=truncated)


def right_padded_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.tensor([[1.0 if t < L else 0.0 for t in range(T)] for L in lengths])


def random_batch(B: int, T: int, seed: int, empty_rows: tuple[int, ...] = (),
                 dtype=torch.float32) -> dict[str, torch.Tensor]:
    """logp = log p with p in (0.05, 0.95); old/ref a perturbation of it; right-padded mask;
    per-sequence advantages broadcast over the mask (0 on padding)."""
    g = torch.Generator().manual_seed(seed)
    p = 0.05 + 0.9 * torch.rand(B, T, generator=g)
    logp = p.log()
    old = (logp + 0.3 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    ref = (logp + 0.3 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    for i in empty_rows:
        lengths[i] = 0
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).float()
    adv = torch.randn(B, 1, generator=g) * mask
    values = torch.randn(B, T, generator=g)
    returns = values + 0.5 * torch.randn(B, T, generator=g)
    old_values = values + 0.3 * torch.randn(B, T, generator=g)
    ent = 2 * torch.rand(B, T, generator=g)
    out = dict(logp=logp, old=old, ref=ref, mask=mask, adv=adv, values=values, returns=returns,
               old_values=old_values, ent=ent)
    return {k: v.to(dtype) for k, v in out.items()}


# ---------------------------------------------------------------------------------------
# Aggregation reference (verl agg_loss / TRL loss_type / ScaleRL prompt-level, as loops)


def ref_aggregate(loss, mask, mode: str, group_size: int = 1, max_tokens: int = 1,
                  count_empty: bool = False) -> float:
    """The aggregated loss of per-token losses ``loss`` (lists [B][T]); padding is never read."""
    B = len(mask)
    lengths = [sum(row) for row in mask]
    tok = [[loss[i][t] for t in range(len(mask[i])) if mask[i][t] > 0] for i in range(B)]
    if mode == "token_mean":  # DAPO / verl token-mean: sum over all tokens / number of tokens
        n = sum(lengths)
        return sum(sum(r) for r in tok) / n if n else 0.0
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
        n = B if count_empty else sum(1 for L in lengths if L > 0)
        per_seq = [sum(r) / len(r) if (r and mode == "seq_mean_token_mean") else sum(r) for r in tok]
        return sum(per_seq) / n if n else 0.0
    if mode == "token_sum_norm":  # Dr. GRPO / TRL dr_grpo: sum / (B * L_max); B counts every row
        return sum(sum(r) for r in tok) / (B * max_tokens) if B else 0.0
    if mode == "prompt_mean":  # ScaleRL: token mean within each prompt's group, mean over prompts
        groups = []
        for g in range(B // group_size):
            rows = range(g * group_size, (g + 1) * group_size)
            n_tok = sum(lengths[i] for i in rows)
            if n_tok:
                groups.append(sum(sum(tok[i]) for i in rows) / n_tok)
        return sum(groups) / len(groups) if groups else 0.0
    raise ValueError(mode)


def ref_token_weights(mask, mode: str, group_size: int = 1, max_tokens: int = 1,
                      count_empty: bool = False) -> list[list[float]]:
    """d(aggregate)/d(loss_it): the per-token weight / count of ``ref_aggregate`` (for gradients)."""
    B, T = len(mask), len(mask[0]) if mask else 0
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if mask[i][t] > 0:
                e = [[1.0 if (a, b) == (i, t) else 0.0 for b in range(T)] for a in range(B)]
                out[i][t] = ref_aggregate(e, mask, mode, group_size, max_tokens, count_empty)
    return out


def ref_masked_whiten(values, mask, shift_mean: bool = True):
    """verl masked_whiten: masked_mean has 1e-8 in its denominator; var with Bessel
    m_sum/(m_sum-1); 1e-8 inside rsqrt."""
    n = sum(sum(r) for r in mask)
    mean = sum(v * m for rv, rm in zip(values, mask) for v, m in zip(rv, rm)) / (n + 1e-8)
    var = sum((v - mean) ** 2 * m for rv, rm in zip(values, mask) for v, m in zip(rv, rm)) / (n + 1e-8)
    var *= n / (n - 1)
    out = [[(v - mean) / math.sqrt(var + 1e-8) for v in rv] for rv in values]
    if not shift_mean:
        out = [[o + mean for o in ro] for ro in out]
    return out


def assert_close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``actual`` (tensor or nested lists) equals ``expected`` (nested lists) elementwise."""
    a = torch.as_tensor(actual.detach() if isinstance(actual, torch.Tensor) else actual,
                        dtype=torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
