"""Weight sync to vLLM, the trainer's side: HF names, dtype casts, byte-bounded buckets.

Trainer names (FSDP / torch.compile / DDP wrappers stripped, the tied ``lm_head`` folded into
the embedding as vLLM's loader expects) are cast to the engine's dtype, grouped into buckets
of at most ``weight_bucket_bytes`` and serialized with safetensors: ``collective_rpc``
arguments travel as msgpack, which carries bytes but not tensors. Every RPC runs under a
timeout so that a stuck worker raises instead of hanging the run.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import torch

from ....errors import WeightSyncTimeout
from ....models.loading import is_moe_config

_T = TypeVar("_T")

#: Module names that wrappers insert into parameter paths: FSDP1, activation
#: checkpointing (``checkpoint_wrapper``), ``torch.compile`` (OptimizedModule).
WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
#: Path components of peft's LoRA layers (``lora_A``, ``lora_B``, ... start with ``lora_``).
LORA_COMPONENTS = frozenset({"base_layer"})
#: Buffers that HF checkpoints may carry and vLLM computes itself (it drops them too).
NOT_LOADED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def hf_weight_name(name: str) -> str:
    """The HF checkpoint name of a trainer parameter name.

    Drops the path components wrappers insert (``_fsdp_wrapped_module``,
    ``_checkpoint_wrapped_module``, ``_orig_mod``) wherever they are, and leading ``module``
    components (DDP / DeepSpeed). Only whole components are removed:
    ``model.layers.0.mlp.up_proj.weight`` is left alone. FSDP1 flat parameters have no HF
    name: they raise (gather a full state dict first).
    """
    parts = name.split(".")
    if any(p in ("_flat_param", "flat_param") for p in parts):
        raise ValueError(
            f"{name!r} is an FSDP1 flat parameter: gather a full state dict "
            "(StateDictType.FULL_STATE_DICT, or FSDP2's DTensor.full_tensor()) first"
        )
    parts = [p for p in parts if p not in WRAPPER_COMPONENTS]
    while parts and parts[0] == "module":
        parts = parts[1:]
    if not parts:
        raise ValueError(f"{name!r} has no parameter name left after removing wrappers")
    return ".".join(parts)


def to_vllm_weight_names(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    tie_word_embeddings: bool,
    embed_name: str = "model.embed_tokens.weight",
    lm_head_name: str = "lm_head.weight",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Map trainer (name, tensor) pairs to the names vLLM's ``load_weights`` expects.

    vLLM reads HF checkpoint names, so this is ``hf_weight_name`` plus:

    - rotary caches (``NOT_LOADED_SUFFIXES``) are dropped;
    - with tied embeddings vLLM's ``lm_head`` *is* the embedding: ``lm_head.weight`` is
      dropped when ``embed_name`` is also given, else sent under ``embed_name`` (a state
      dict may keep only one of the two aliases);
    - a name that occurs twice after mapping raises (two tensors for one parameter);
    - a LoRA tensor (peft's ``lora_A`` / ``lora_B`` / ``base_layer`` names) raises: vLLM's
      ``load_weights`` knows only the plain model's names, so the trainer sends merged
      weights (``runtime.lora.merged_weights`` / ``merge_state``).

    The input is consumed lazily (a held-back tied ``lm_head`` is the only tensor kept).
    """
    seen: set[str] = set()
    held_lm_head: torch.Tensor | None = None
    for raw_name, tensor in named_tensors:
        name = hf_weight_name(raw_name)
        if any(p in LORA_COMPONENTS or p.startswith("lora_") for p in name.split(".")):
            raise ValueError(f"{raw_name!r} is a LoRA tensor: merge the adapters into the base "
                             "weights before the sync (runtime.lora.merge_state)")
        if name.endswith(NOT_LOADED_SUFFIXES):
            continue
        if name in seen or (name == lm_head_name and held_lm_head is not None):
            raise ValueError(f"two tensors map to the weight name {name!r} (from {raw_name!r})")
        if tie_word_embeddings and name == lm_head_name:
            held_lm_head = tensor
            continue
        seen.add(name)
        yield name, tensor
    if held_lm_head is not None and embed_name not in seen:
        yield embed_name, held_lm_head


def materialize(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A plain, contiguous CPU tensor: DTensors gathered (``full_tensor()``, a collective
    every rank must join), floating tensors cast to ``dtype`` when given."""
    if hasattr(tensor, "full_tensor"):  # torch.distributed.tensor.DTensor (FSDP2)
        tensor = tensor.full_tensor()
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.to("cpu").contiguous()


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_by_bytes(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs, in order, into lists of at most ``max_bytes`` bytes.

    A tensor larger than ``max_bytes`` travels alone. Empty buckets are never yielded.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def pack_bucket(bucket: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """Serialize (name, CPU tensor) pairs to safetensors bytes (any dtype, bf16 included)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in bucket:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in storages and tensor.numel():  # safetensors refuses shared storage
            tensor = tensor.clone()
        storages.add(ptr)
        tensors[name] = tensor.contiguous()
    return save(tensors)


def unpack_bucket(payload: bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``pack_bucket``."""
    from safetensors.torch import load

    return list(load(bytes(payload)).items())


def call_with_timeout(fn: Callable[[], _T], timeout: float | None, what: str) -> _T:
    """Run ``fn()`` and return its result, or raise ``WeightSyncTimeout`` after ``timeout`` s.

    The call runs on a daemon thread: on a timeout it is abandoned (it cannot be
    cancelled), so the caller must treat the engine as broken. ``None`` waits forever.
    """
    if timeout is None:
        return fn()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name=f"rldsl-vllm-{what}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise WeightSyncTimeout(
            f"vLLM did not finish {what} within {timeout:.0f} s. A worker may have died or "
            "be stuck in a collective; the engine is now unusable: restart it (and check "
            "the vLLM worker logs). Raise VLLMEngine(weight_sync_timeout=...) if the "
            "transfer is just slow."
        )
    if "error" in box:
        raise box["error"]
    return box["result"]


def checkpoint_namer(model: str | Any, config: Any) -> Callable[[Iterable[tuple[str, torch.Tensor]]],
                                                                Iterator[tuple[str, torch.Tensor]]] | None:
    """(name, tensor) pairs of a mixture-of-experts transformers model -> the same weights under the
    names and layout of its checkpoint, which vLLM's loader reads; None for a model whose (text)
    ``config`` declares no routed experts (its names are its checkpoint's). transformers 5
    converts some families at load (a mixture-of-experts model's experts fused into 3-D
    ``mlp.experts.gate_up_proj`` /
    ``down_proj`` parameters; Mixtral's ``block_sparse_moe`` renamed ``mlp``) and reverts that when it
    saves; vLLM's loader takes the saved form (fed the fused tensor, Qwen3-MoE loaded it wrongly
    and Mixtral refused it). This reverts each tensor with transformers' own
    ``revert_weight_conversion``, on a meta-device model of the folder's config (no weights)."""
    if not is_moe_config(config.to_dict()):
        return None
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))

    def rename(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named:
            yield from revert_weight_conversion(meta, {name: tensor}).items()
    return rename
