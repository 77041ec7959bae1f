"""The methods vLLM mixes into each of its GPU workers: the receiving side of weight sync.

Each bucket is loaded with the model's own ``load_weights`` (the path vLLM reads an HF
checkpoint with: it fuses q/k/v and gate/up and shards for tensor parallelism), in place,
so CUDA graphs stay valid. This module is imported inside vLLM's worker processes by its
qualified name (``WORKER_EXTENSION`` in engine.py).
"""
from __future__ import annotations

from typing import Any

import torch

from .weights import unpack_bucket

class RldslWorkerExtension:
    """Methods vLLM mixes into each of its GPU workers (``worker_extension_cls``).

    Called through ``LLM.collective_rpc("rldsl_...")``. Inside a worker ``self`` is vLLM's
    worker: ``self.model_runner`` holds the model. Every name starts with ``rldsl_`` so it
    cannot clash with the worker's own attributes (vLLM asserts that).
    """

    def rldsl_begin_weight_update(self) -> int:
        """Start counting which parameters the coming buckets write."""
        self.rldsl_loaded_names = set()
        return 0

    def rldsl_load_weights(self, payload: bytes) -> int:
        """Load one packed bucket of HF-named tensors in place; returns how many."""
        weights = unpack_bucket(payload)
        model = _worker_model(self)
        with torch.no_grad():
            loaded = model.load_weights(weights)
        if getattr(self, "rldsl_loaded_names", None) is None:
            self.rldsl_loaded_names = set()
        if loaded is None:  # some models do not report: no completeness check then
            self.rldsl_loaded_names = None
        elif self.rldsl_loaded_names is not None:
            self.rldsl_loaded_names.update(loaded)
        device = getattr(self, "device", None)
        if device is not None and getattr(device, "type", None) == "cuda":
            torch.cuda.synchronize(device)
        return len(weights)

    def rldsl_finish_weight_update(self) -> list[str] | None:
        """Names of model parameters no bucket wrote since the last begin (None = unknown)."""
        loaded = getattr(self, "rldsl_loaded_names", None)
        self.rldsl_loaded_names = None
        if loaded is None:
            return None
        names = [n for n, _ in _worker_model(self).named_parameters()]
        return sorted(n for n in names if n not in loaded)

    def rldsl_param_checksums(self, names: list[str] | None = None) -> dict[str, float]:
        """{vLLM parameter name: float64 sum of its values} (for smoke tests)."""
        params = dict(_worker_model(self).named_parameters())
        wanted = params if names is None else {n: params[n] for n in names if n in params}
        return {n: float(p.detach().double().sum().item()) for n, p in wanted.items()}


def _worker_model(worker: Any) -> torch.nn.Module:
    runner = worker.model_runner
    get_model = getattr(runner, "get_model", None)  # unwraps CUDA-graph wrappers
    return get_model() if callable(get_model) else runner.model
