"""A spec as a loss for the Tinker API: the layout of a ``forward_backward`` call's datums as the
rows a compiled spec reads, shared by ``rldsl serve-tinker`` (a spec named in
``loss_fn_config.rldsl_spec``) and the client side (:func:`custom_loss`, a function for the
client's ``forward_backward_custom``, so a spec is a loss against any Tinker-compatible service).

A datum of the call is one row: its per-position ``logprobs`` (the policy's, with gradient), the
sampler's logprobs (``loss_fn_inputs["logprobs"]``, the old policy) and ``advantages``; its mask
is ``loss_fn_inputs["mask"]`` when sent, else the sampled positions (sampler logprobs or
advantages non-zero: the cookbook zeroes both on the prompt). A mean-aggregated spec divides by
the whole call's count (or by ``denominator`` when given). Metrics are named ``name:mean``, as the
client folds metrics.

    import rldsl.tinker
    loss_fn = rldsl.tinker.custom_loss("dapo")
    training_client.forward_backward_custom(data, loss_fn).result()
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

import rldsl


def _rows(values: Sequence[torch.Tensor], T: int) -> torch.Tensor:
    """[len(values), T] float32, each value right padded with 0: one op (``pad_sequence``), not one
    per datum -- a recipe's call has hundreds of datums, a differentiable one (the logprobs) too."""
    out = torch.nn.utils.rnn.pad_sequence([v.reshape(-1).float() for v in values], batch_first=True)
    return out if out.shape[1] == T else torch.nn.functional.pad(out, (0, T - out.shape[1]))


def _column(inputs: Sequence[Mapping[str, Any]], key: str, T: int) -> torch.Tensor:
    """[len(inputs), T] of one ``loss_fn_inputs`` key, filled in bulk: the datums' values end to
    end (one numpy concatenation) into the padded rows' real positions."""
    values = [np.asarray(_plain(d[key]), dtype=np.float32).reshape(-1) for d in inputs]
    lengths = np.fromiter((v.shape[0] for v in values), dtype=np.int64, count=len(values))
    out = np.zeros((len(values), T), dtype=np.float32)
    out[np.arange(T) < lengths[:, None]] = np.concatenate(values) if values else []
    return torch.from_numpy(out)


def _plain(value: Any) -> Any:
    """A tinker ``TensorData`` as numpy (it has ``to_numpy``), anything else as given."""
    return value.to_numpy() if hasattr(value, "to_numpy") else value


def rows_loss(compiled: Any, logprobs: Sequence[torch.Tensor], inputs: Sequence[Mapping[str, Any]], *,
              all_positions: bool = False, adv_key: str = "advantages", ratio_mask_key: str | None = None,
              denominator: float | None = None, reference: Sequence[torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """(the call's loss, its metrics) of ``compiled`` (a CompiledAlgorithm) over the datums.

    ``all_positions``: every position is in the mask and the sampler logprobs may be absent (the
    Tinker built-ins: sums over all positions; ``ratio_mask_key`` then names an input that
    replaces the mask, as GSPO's ``sequence_ratio_mask``); else the mask rule of the module
    docstring and a denominator over the whole call. ``reference``: per datum the reference
    policy's logprobs, for a spec with a KL term (the server's: the policy with its adapters off)."""
    lengths = torch.tensor([int(lp.shape[0]) for lp in logprobs])
    T = int(lengths.max())
    valid = (torch.arange(T) < lengths[:, None]).float()  # [B, T]
    logp = _rows(logprobs, T)  # [B, T], with gradient
    adv = _column(inputs, adv_key, T)
    old = _column(inputs, "logprobs", T) if all("logprobs" in d for d in inputs) else logp.detach()
    if all_positions:
        mask = valid
        if ratio_mask_key is not None and all(ratio_mask_key in d for d in inputs):
            mask = _column(inputs, ratio_mask_key, T)
    elif all("mask" in d for d in inputs):
        mask = _column(inputs, "mask", T) * valid
    else:
        mask = ((old != 0) | (adv != 0)).float() * valid
    if not all_positions and denominator is None:
        denominator = float(compiled.denominator(mask, group_size=1))
    ref = _rows([r.detach() for r in reference], T) if reference is not None else None
    out = compiled.loss(logp, old, adv, mask, group_size=1, ref_logprobs=ref,
                        denominator=None if all_positions else max(float(denominator), 1.0))
    metrics = {f"{k}:mean": float(v) for k, v in out.metrics.items() if isinstance(v, int | float)}
    return out.loss, metrics


def custom_loss(spec: str | Any, denominator: float | None = None
                ) -> Callable[[list[Any], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]:
    """A function ``(data, logprobs_list) -> (loss, metrics)`` for the Tinker client's
    ``forward_backward_custom``, computing ``spec`` (a library name, a path, an ``Algorithm``
    or a ``CompiledAlgorithm``) as ``rldsl serve-tinker`` computes it when the spec is named in
    ``loss_fn_config.rldsl_spec``. The datums must carry ``logprobs`` (the sampler's) and
    ``advantages`` in their ``loss_fn_inputs``."""
    if isinstance(spec, str):
        spec = rldsl.load(spec)
    compiled = spec if hasattr(spec, "loss") and hasattr(spec, "denominator") else rldsl.compile(spec, compile=False)

    def loss(data: list[Any], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        return rows_loss(compiled, logprobs, [d.loss_fn_inputs for d in data], denominator=denominator)
    return loss
