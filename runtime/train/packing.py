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

Not every architecture takes packed rows (OPT's learned positions ignore ``position_ids``):
:func:`packing_supported` checks each model once on two short sequences, and a model that
fails falls back to padded forwards with one warning.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

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
    """

    input_ids: Tensor
    position_ids: Tensor
    predictor: Tensor
    target: Tensor
    out: Tensor
    lengths: list[int]

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
    n = mask.long().sum(1)  # [B] real tokens
    first = mask.long().argmax(1)  # [B] first real column
    cols = torch.arange(T, device=mask.device)
    last = torch.where(mask, cols, -1).amax(1)  # [B] last real column
    if bool((n == 0).any()) or bool((last - first + 1 != n).any()) or bool((first >= T - Tr).any()):
        return None
    lengths = (n - 1).tolist()  # the last token of a sequence predicts nothing: not fed
    firsts = first.tolist()
    bins = pack(lengths, max(row_tokens or max(lengths), 1))
    loads = [sum(lengths[b] for b in rows) for rows in bins]
    S = max(max(loads), 1)
    R = len(bins)
    dev = input_ids.device
    src, dst = [], []          # token copies: padded [B*T] -> packed [R*S]
    pred, tgt, out = [], [], []  # response tokens
    positions = torch.empty(R * S, dtype=torch.long, device=dev)
    for r, rows in enumerate(bins):
        offset = r * S
        for b in rows:
            nb, fb = lengths[b], firsts[b]
            src.append(torch.arange(b * T + fb, b * T + fb + nb, device=dev))
            dst.append(torch.arange(offset, offset + nb, device=dev))
            positions[offset:offset + nb] = torch.arange(nb, device=dev)
            # response columns c in [T - Tr, fb + nb]: the state at column c - 1 predicts token c
            c0 = T - Tr
            k = fb + nb + 1 - c0  # real response tokens of row b
            if k > 0:
                pred.append(torch.arange(offset + c0 - 1 - fb, offset + c0 - 1 - fb + k, device=dev))
                tgt.append(torch.arange(b * T + c0, b * T + c0 + k, device=dev))
                out.append(torch.arange(b * Tr, b * Tr + k, device=dev))
            offset += nb
        fill = (r + 1) * S - offset  # filler: one more "sequence" starting at position 0
        positions[offset:offset + fill] = torch.arange(fill, device=dev)
    src_i, dst_i = torch.cat(src), torch.cat(dst)
    ids = input_ids.new_full((R * S,), _filler_id(input_ids, mask))
    ids[dst_i] = input_ids.reshape(-1)[src_i]
    empty = torch.zeros(0, dtype=torch.long, device=dev)
    return PackedRows(ids.view(R, S), positions.view(R, S),
                      torch.cat(pred) if pred else empty, torch.cat(tgt) if tgt else empty,
                      torch.cat(out) if out else empty, lengths)


def _filler_id(input_ids: Tensor, mask: Tensor) -> int:
    """A token id for the filler (any id of the batch: its states are never read)."""
    return int(input_ids[mask][0]) if bool(mask.any()) else 0


def packed_hidden(body: nn.Module, rows: PackedRows) -> Tensor:
    """States [M, H] predicting each real response token, from one packed forward of the
    transformer ``body`` (``models.loading.backbone`` of a causal LM)."""
    out = body(input_ids=rows.input_ids, position_ids=rows.position_ids,
                          attention_mask=None, use_cache=False)
    h = out.last_hidden_state  # [R, S, H]
    return h.reshape(-1, h.shape[-1]).index_select(0, rows.predictor)  # [M, H]


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
                      "positions ignore restarting position ids); its forwards run padded", stacklevel=3)
    return ok


def _states_agree(body: nn.Module) -> bool:
    param = next(body.parameters())
    dev = param.device
    vocab = int(getattr(body.config, "vocab_size", 8) or 8)
    a = (torch.arange(7, device=dev) * 5 + 3) % vocab  # two sequences of distinct tokens
    b = (torch.arange(5, device=dev) * 7 + 11) % vocab
    was = body.training
    body.eval()
    try:
        with torch.no_grad(), torch.autocast(device_type=dev.type, enabled=False):
            def run(ids: Tensor, pos: Tensor) -> Tensor:
                return body(input_ids=ids[None], position_ids=pos[None], attention_mask=None,
                            use_cache=False).last_hidden_state[0].float()
            ha = run(a, torch.arange(7, device=dev))
            hb = run(b, torch.arange(5, device=dev))
            both = run(torch.cat([a, b]), torch.cat([torch.arange(7, device=dev), torch.arange(5, device=dev)]))
    finally:
        body.train(was)
    ref = torch.cat([ha, hb])
    tol = (1e-4 if param.dtype == torch.float32 else 5e-2) * (1.0 + float(ref.abs().max()))
    return bool(torch.isfinite(both).all()) and float((both - ref).abs().max()) <= tol
