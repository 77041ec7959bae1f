"""The methods vLLM mixes into each of its workers: the receiving side of weight sync.

A weight update is vLLM's layerwise in-place reload, split over our buckets as vLLM's own
weight-transfer engines split it over their chunks (vLLM >= 0.32,
``vllm.model_executor.model_loader.reload``):

- ``rldsl_begin_weight_update``: ``initialize_layerwise_reload(model)`` puts every layer
  back in checkpoint format (on the meta device) and makes its weight loaders buffer;
- ``rldsl_load_weights`` (once per bucket): ``model.load_weights`` with HF-named tensors,
  the path vLLM reads a checkpoint with (it fuses q/k/v and gate/up, shards for tensor
  parallelism); a layer is materialized, processed (``process_weights_after_loading``:
  on CPU that repacks the linear weights for oneDNN and empties ``layer.weight``) and
  copied into its original storage as soon as all its tensors have arrived;
- ``rldsl_finish_weight_update``: ``finalize_layerwise_reload`` processes what is left
  (attention layers) and reports the parameters no bucket wrote.

Storage is preserved (CUDA graphs stay valid). Releases without the reload module (vLLM <
0.32) load each bucket with ``model.load_weights`` alone: complete for unquantized models
on CUDA, where ``process_weights_after_loading`` changes nothing, and wrong on CPU (vLLM's
CPU backend replaces the parameters after loading; ``VLLMEngine`` refuses that case).

``rldsl_read_weights`` reads the weights back as the kernels use them, under HF names, so
tests can compare the engine with the trainer tensor by tensor. This module is imported
inside vLLM's worker processes by its qualified name (``WORKER_EXTENSION`` in engine.py).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from .routing import RoutingWorkerMixin
from .weights import pack_bucket, unpack_bucket


def layerwise_reload_api() -> tuple[Any, Any] | None:
    """(initialize_layerwise_reload, finalize_layerwise_reload) of the installed vLLM, or None
    when it predates them (vLLM < 0.32)."""
    try:
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


class RldslWorkerExtension(RoutingWorkerMixin):
    """Methods vLLM mixes into each of its workers (``worker_extension_cls``).

    Called through ``LLM.collective_rpc("rldsl_...")``. Inside a worker ``self`` is vLLM's
    worker: ``self.model_runner`` holds the model, ``self.vllm_config`` its configuration.
    Every name starts with ``rldsl_`` so it cannot clash with the worker's own attributes
    (vLLM asserts that). The ``rldsl_routing_*`` methods (routing.py) record the experts of a
    mixture-of-experts model.
    """

    def rldsl_begin_weight_update(self) -> bool:
        """Start an update: layerwise reload set up (when vLLM has it), loaded names reset.
        Returns whether the layerwise reload is used."""
        self.rldsl_loaded_names = set()
        has_config = getattr(self, "vllm_config", None) is not None  # a real vLLM worker
        self.rldsl_reload = layerwise_reload_api() if has_config else None
        if self.rldsl_reload is not None:
            initialize, _ = self.rldsl_reload
            self.rldsl_moe_kernels = detach_moe_kernels(_worker_model(self))
            with _current_config(self), torch.no_grad():
                initialize(_worker_model(self))
        return self.rldsl_reload is not None

    def rldsl_load_weights(self, payload: bytes) -> int:
        """Load one packed bucket of HF-named tensors; returns how many tensors it held."""
        weights = unpack_bucket(payload)
        model = _worker_model(self)
        with _current_config(self), torch.no_grad():
            loaded = model.load_weights(weights)
        if getattr(self, "rldsl_loaded_names", None) is None:
            self.rldsl_loaded_names = set()
        if loaded is None:  # some models do not report: no completeness check then
            self.rldsl_loaded_names = None
        elif self.rldsl_loaded_names is not None:
            self.rldsl_loaded_names.update(loaded)
        _synchronize(self)
        return len(weights)

    def rldsl_finish_weight_update(self) -> list[str] | None:
        """Finish the layerwise reload; names of model parameters no bucket wrote since the
        last begin (None = unknown)."""
        model = _worker_model(self)
        reload = getattr(self, "rldsl_reload", None)
        self.rldsl_reload = None
        if reload is not None:
            _, finalize = reload
            try:
                with _current_config(self), torch.no_grad(), _quiet(finalize):
                    finalize(model, self.vllm_config.model_config)
                    reprocess_tied_layers(model)
            finally:
                reattach_moe_kernels(getattr(self, "rldsl_moe_kernels", None) or [])
                self.rldsl_moe_kernels = None
            _synchronize(self)
        loaded = getattr(self, "rldsl_loaded_names", None)
        self.rldsl_loaded_names = None
        if loaded is None:
            return None
        return sorted(n for n in map(plain_name, (n for n, _ in model.named_parameters())) if n not in loaded)

    def rldsl_read_weights(self, names: list[str] | None = None) -> bytes:
        """The weights the kernels compute with, HF-named, packed with ``pack_bucket``
        (float32 for floating tensors; ``names`` = only those)."""
        wanted = None if names is None else set(names)
        out = [(n, t.float() if t.is_floating_point() else t)
               for n, t in effective_weights(_worker_model(self)) if wanted is None or n in wanted]
        return pack_bucket([(n, t.cpu()) for n, t in out])


def detach_moe_kernels(model: torch.nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    """Make the coming reload process each mixture-of-experts layer as a first load does;
    returns what ``reattach_moe_kernels`` puts back afterwards.

    vLLM's unquantized fused-MoE method treats a reprocessing as a weight update when its
    kernel exists already (``UnquantizedFusedMoEMethod._setup_kernel``): it copies the
    weights in checkpoint layout into the kernel's storage and skips the experts' own
    ``process_weights_after_loading``. On CPU that step is the kernel's layout (the
    intermediate size padded to the kernel's alignment, the weights prepacked for its
    grouped GEMM), so every sync left the experts' storage holding unpacked weights read as
    packed ones (measured on the tiny Qwen3-MoE: syncing its own unchanged weights moved 4.4 %
    of the routing and the logprobs by 0.06). With the kernel detached, the layer is padded
    and prepacked as at load time, and the reload copies that layout into the original
    storage. Only layers whose experts have such a step are touched (on CUDA's unquantized
    backends the step is empty and the update path is right).
    """
    detached = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not _has_own_weight_processing(experts):
            continue
        saved = {name: getattr(method, name) for name in ("moe_kernel", "moe_quant_config") if hasattr(method, name)}
        method.moe_kernel = None
        detached.append((method, saved))
    return detached


def reattach_moe_kernels(detached: list[tuple[Any, dict[str, Any]]]) -> None:
    """Put back the kernels ``detach_moe_kernels`` took: their configuration is the one the
    reload rebuilt, and they keep any tensor references (biases) in the original storage the
    reload copied into."""
    for method, saved in detached:
        for name, value in saved.items():
            setattr(method, name, value)


def _has_own_weight_processing(experts: Any) -> bool:
    """Whether an experts kernel overrides ``process_weights_after_loading`` (the base class
    in vLLM's modular kernel does nothing)."""
    for klass in type(experts).__mro__:
        if "process_weights_after_loading" in vars(klass):
            return not klass.__module__.endswith("fused_moe.modular_kernel")
    return False


def reprocess_tied_layers(model: torch.nn.Module) -> list[str]:
    """Run ``process_weights_after_loading`` again on every layer whose weight is shared
    with another layer; returns their names.

    vLLM's layerwise reload processes a shared parameter in one of its layers only (its
    documented limitation 2, ``vllm.model_executor.model_loader.reload``): the LM head of a
    tied-embedding model keeps kernel state built from the old values -- on CPU the oneDNN
    handle its logits are computed with, packed from the old embedding (measured: logprobs
    off by up to 0.9 after one sync). Processing is idempotent for these layers (on CUDA a
    no-op for unquantized embeddings).
    """
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = dict(module.named_parameters(recurse=False)).get("weight")
        if weight is not None and weight.numel() > 0:
            owners.setdefault(id(weight), []).append((name, module))
    done = []
    for group in owners.values():
        if len(group) < 2:
            continue
        for name, module in group:
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                done.append(name)
    return done


@torch.no_grad()
def effective_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter of a vLLM model, as its kernels use it.

    - linear layers and the LM head are read through their kernel: ``apply`` on the identity
      matrix gives ``I @ W^T``, transposed back to ``W`` [N, K]. On CPU their weights live
      in packed oneDNN / sgl handles (linear layers' ``weight`` is emptied), so this is
      what the logits are computed with, not a copy that may have gone stale; an
      embedding used for lookup is read as is;
    - fused modules (the model's ``packed_modules_mapping``: ``qkv_proj`` -> q/k/v,
      ``gate_up_proj`` -> gate/up) are split by their output sizes into the HF tensors;
    - the embedding's padding rows (vLLM pads the vocabulary to a multiple of 64) are cut;
    - a mixture-of-experts layer's experts are left out: their kernel computes
      ``down(act(gate x) * up x)`` from weights in its own packed layout, which no product with
      the identity gives back (their routers, linear layers, are read as above).

    Names are HF's for models whose vLLM module tree mirrors HF's (Llama, Qwen2, Mistral).
    With tensor parallelism these are this worker's shards.
    """
    packed = getattr(model, "packed_modules_mapping", None) or {}
    for wrapped_name, module in model.named_modules():
        if hasattr(getattr(module, "quant_method", None), "moe_kernel"):
            continue  # a MoE layer's experts: packed for their grouped GEMM, not readable as W (see above)
        module_name = plain_name(wrapped_name)
        prefix, _, leaf = module_name.rpartition(".")
        for param_name, param in module.named_parameters(recurse=False):
            tensor = param.detach()
            if param_name == "weight" and _computes_through_kernel(module):
                tensor = _weight_through_kernel(module, param)
            if param_name == "weight" and tensor.shape[0] == getattr(module, "num_embeddings_padded", -1):
                tensor = tensor[: module.num_embeddings]  # [V, H] without the padding rows
            parts, sizes = packed.get(leaf), getattr(module, "output_partition_sizes", None)
            if parts and sizes and len(parts) == len(sizes) and tensor.shape[0] == sum(sizes):
                for part, piece in zip(parts, tensor.split(list(sizes), dim=0)):
                    yield ".".join(p for p in (prefix, part, param_name) if p), piece
            else:
                yield f"{module_name}.{param_name}", tensor


def plain_name(name: str) -> str:
    """A vLLM parameter or module name without the ``base_layer`` level of vLLM's LoRA wrappers
    (an engine built with ``enable_lora`` wraps each adaptable layer and holds the original as
    ``base_layer``): the name ``load_weights`` reports and HF uses."""
    return name.replace(".base_layer.", ".").removesuffix(".base_layer")


def _computes_through_kernel(module: torch.nn.Module) -> bool:
    """A vLLM layer whose weight is used through ``quant_method.apply`` (linear layers, the
    LM head), not an embedding looked up by index."""
    method = getattr(module, "quant_method", None)
    if method is None or not hasattr(method, "apply"):
        return False
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return isinstance(module, ParallelLMHead) or not isinstance(module, VocabParallelEmbedding)


def _weight_through_kernel(module: torch.nn.Module, param: torch.Tensor) -> torch.Tensor:
    """``W`` [N, K] of a layer computing ``x @ W^T`` with its weight (maybe packed in a
    kernel handle, its ``weight`` parameter then empty)."""
    k = int(param.shape[1]) if param.dim() == 2 and param.numel() else \
        int(getattr(module, "input_size_per_partition", None) or module.input_size)  # a router: replicated
    eye = torch.eye(k, dtype=param.dtype, device=param.device)  # [K, K]
    return module.quant_method.apply(module, eye).t().contiguous()  # (I @ W^T)^T = W


def _worker_model(worker: Any) -> torch.nn.Module:
    runner = worker.model_runner
    get_model = getattr(runner, "get_model", None)  # unwraps CUDA-graph wrappers
    return get_model() if callable(get_model) else runner.model


def _current_config(worker: Any) -> contextlib.AbstractContextManager:
    """vLLM's ``set_current_vllm_config`` (weight processing reads it), as vLLM's own
    ``Worker.reload_weights`` does."""
    config = getattr(worker, "vllm_config", None)
    if config is None:  # not a vLLM worker (the fast tests' stand-ins)
        return contextlib.nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(config)


@contextlib.contextmanager
def _quiet(function: Any) -> Iterator[None]:
    """Silence the warnings of ``function``'s module (vLLM's layerwise reload warns "Failed to
    load weights" at every sync for layers with nothing to load: the rotary embedding, a tied
    LM head). Unwritten parameters are what ``rldsl_finish_weight_update`` reports instead."""
    logger = logging.getLogger(getattr(function, "__module__", "") or "vllm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _synchronize(worker: Any) -> None:
    device = getattr(worker, "device", None)
    if device is not None and getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)
