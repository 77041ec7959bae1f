"""A KV cache for the sampler that grows in place: ``preallocated_cache(model, capacity)``.

transformers' ``DynamicCache`` grows by ``torch.cat`` at every token: each decode step
copies the whole cache of every layer, so the copies grow with the square of the answer's
length (at hidden 256, 4 layers, 64 rows x 128 tokens, removing them took sampling on one CPU
core from 2.19 s to 1.91 s; bench/README.md). Here each layer's keys and values live in one
buffer [B, heads, capacity, d] allocated at the prefill; a step writes its new slot in place
and the attention reads a view of the filled prefix ``[:, :, :n]`` -- the same keys and
values in the same order, so the same attention, without the copies.

Only for a cache of full-attention ``DynamicLayer`` s (``models.plain_kv_cache``); the rows
operations the sampler uses (``batch_repeat_interleave`` after the shared prefill,
``batch_select_indices`` when rows finish) copy only the filled prefix, each with one gather
or broadcast into the new buffers (no intermediate copy).
"""
from __future__ import annotations

import functools

import torch
from torch import nn


@functools.cache
def _layer_class():
    """The layer class, built on first use (transformers 4.x has no ``DynamicLayer``; its
    models take ``model.generate``, never this cache)."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A full-attention layer whose keys / values are views of a preallocated buffer."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self.length = 0
            self._k: torch.Tensor | None = None  # [B, heads, capacity, d]
            self._v: torch.Tensor | None = None

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            B, H, _, d = key_states.shape
            self._k = key_states.new_empty((B, H, self.capacity, d))
            self._v = value_states.new_empty((B, H, self.capacity, value_states.shape[-1]))
            self.is_initialized = True

        def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
            self.keys = self._k[:, :, : self.length]  # [B, heads, n, d]
            self.values = self._v[:, :, : self.length]
            return self.keys, self.values

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, t = self.length, key_states.shape[-2]
            if n + t > self.capacity:
                raise RuntimeError(f"preallocated KV cache: {n} + {t} tokens exceed its capacity {self.capacity}")
            self._k[:, :, n : n + t] = key_states
            self._v[:, :, n : n + t] = value_states
            self.length = n + t
            return self._views()

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def batch_repeat_interleave(self, repeats: int) -> None:
            """Each row ``repeats`` times: new buffers, the filled prefix written once into them
            (a broadcast of each row, no intermediate repeated copy)."""
            if not self.is_initialized or repeats == 1:
                return
            n = self.length
            self._k, self._v = (self._repeated(buf, repeats, n) for buf in (self._k, self._v))
            self._views()

        def _repeated(self, buf: torch.Tensor, repeats: int, n: int) -> torch.Tensor:
            B, H, _, d = buf.shape
            out = buf.new_empty((B * repeats, H, self.capacity, d))
            out.view(B, repeats, H, self.capacity, d)[:, :, :, :n] = buf[:, None, :, :n]
            return out

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """Keep the rows ``indices``, in that order: one ``index_select`` into new buffers --
            of the whole buffers once the filled prefix is at least half of them (a contiguous
            gather beats a strided one there), else of the prefix straight into the new buffers'
            prefix. Never an intermediate copy of the selected rows."""
            if not self.is_initialized:
                return
            n = self.length
            if 2 * n >= self.capacity:
                self._k, self._v = self._k.index_select(0, indices), self._v.index_select(0, indices)
            else:
                self._k, self._v = (self._selected(buf, indices, n) for buf in (self._k, self._v))
            self._views()

        @staticmethod
        def _selected(buf: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
            out = buf.new_empty((indices.shape[0], *buf.shape[1:]))
            torch.index_select(buf[:, :, :n], 0, indices, out=out[:, :, :n])
            return out

        def crop(self, tokens_to_remove: int) -> None:  # pragma: no cover - the sampler never crops
            raise NotImplementedError("the preallocated KV cache is not croppable")

        def reset(self) -> None:
            self._k = self._v = None
            self.length = 0
            super().reset()

    return PreallocatedLayer


def preallocated_cache(model: nn.Module, capacity: int):
    """A ``DynamicCache`` for ``model`` whose layers hold up to ``capacity`` tokens each,
    written in place. The model must have a plain KV cache (``models.plain_kv_cache``)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer
    cache = DynamicCache(config=model.config)
    if not cache.layers or not all(type(layer) is DynamicLayer for layer in cache.layers):
        raise ValueError(f"{type(model).__name__}: the preallocated KV cache needs full-attention layers only")
    cache.layers = [_layer_class()(capacity) for _ in cache.layers]
    return cache
