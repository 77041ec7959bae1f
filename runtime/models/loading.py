"""The policy model: loading it and its tokenizer from an HF folder, and its structure
(the transformer backbone, parameters shared under several names)."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

from ..errors import RunError

if TYPE_CHECKING:
    from torch import nn


def is_vision_folder(path: str | Path) -> bool:
    """Whether the HF folder at ``path`` holds a vision-language model (its config.json has a
    ``vision_config``; models/vision.py, docs/vlm.md). Reads config.json only."""
    import json
    try:
        return "vision_config" in json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def auto_class(path: str | Path) -> Any:
    """The transformers auto class of the HF folder at ``path``: a vision-language folder's
    image-text-to-text model (``Qwen2VLForConditionalGeneration``), else the causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if is_vision_folder(path) else AutoModelForCausalLM


def load_policy(path: Path, dtype: str) -> nn.Module:
    """The causal LM of an HF folder, in ``dtype`` ("float32", "bfloat16", ...), KV cache on;
    a vision-language folder's image-text-to-text model (``Qwen2VLForConditionalGeneration``)."""
    auto = auto_class(path)
    try:
        with quiet_transformers():  # no "Loading weights" bar
            model = auto.from_pretrained(str(path), dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise RunError(f"could not load the model from {path}: {e}") from None
    model.config.use_cache = True
    return model


def master_dtype(dtype: str) -> str:
    """The dtype the trainer keeps its parameters (and AdamW state) in: float32 for a
    16-bit ``model.dtype``, which then only sets the compute dtype (autocast) and the
    rollout engine's copy -- bf16 parameters would round away most small updates."""
    return "float32" if dtype in ("bfloat16", "float16") else dtype


def autocast_dtype(dtype: str) -> torch.dtype | None:
    """The autocast dtype of the training forwards for ``model.dtype`` (None: no autocast)."""
    return getattr(torch, dtype) if dtype in ("bfloat16", "float16") else None


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer block in the backward pass (non-reentrant: works with
    inputs that need no grad, and with ``torch.no_grad`` forwards untouched)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise RunError(f"{type(model).__name__} does not support gradient checkpointing "
                       "(train.gradient_checkpointing=false)")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x spelling
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def load_tokenizer(path: Path) -> Any:
    """The tokenizer of an HF folder, left padding. Without a pad token: the special token its
    vocabulary reserves for padding, if any (Llama 3's ``<|finetune_right_pad_id|>``), else EOS."""
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise RunError(f"could not load the model from {path}: {e}") from None
    if tok.pad_token_id is None:
        reserved = [t for t in tok.all_special_tokens + [a.content for a in tok.added_tokens_decoder.values()
                                                          if a.special]
                    if "pad" in t.lower() and t != tok.eos_token]
        tok.pad_token = reserved[0] if reserved else tok.eos_token
    tok.padding_side = "left"
    return tok


def policy_on_meta(path: str | Path, state: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """The HF model of a folder's config built on the meta device (no weights read), holding
    ``state`` (assigned, not copied) when given."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(str(path))
    auto = auto_class(path)
    with torch.device("meta"):
        model = auto.from_config(config)
    if state is not None:
        model.load_state_dict(with_tied(own_names(state, model), model), assign=True)
        model.tie_weights()
    return model


def disable_transformers_progress(errors_only: bool = False) -> None:
    """Turn transformers' progress bars off for this process (and its warnings with ``errors_only``)."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if errors_only:
        hf_logging.set_verbosity_error()


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hide transformers' progress bars ("Loading weights", "Writing model shards") for the
    ``from_pretrained`` / ``save_pretrained`` inside: every command loads and writes models
    through this, so neither a run's progress display nor ``rldsl eval`` / ``export`` /
    ``reward rm:`` output shows them; transformers' own setting is restored after."""
    from transformers.utils import logging as hf_logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------- structure

def backbone(model: nn.Module) -> nn.Module:
    """The transformer body of an HF causal LM (``model.<base_model_prefix>``): hidden states, no head."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    if base is None:
        raise TypeError(f"{type(model).__name__}: cannot find the backbone (attribute {prefix!r}); "
                        "a transformers *ForCausalLM model is needed")
    return base


def head_weights(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output head's (weight [V, H], bias) as the model's own forward applies them. A LoRA
    adapter on the head (peft's ``lora.Linear``: ``model.lora.target_modules`` naming ``lm_head``,
    serve-tinker's ``train_unembed``) adds ``scaling * B @ A`` of each active adapter, with
    gradient to A and B -- reading ``head.weight`` alone gave the base's, and the adapter never
    trained. Merged or disabled adapters (the reference forward) add nothing. LoRA dropout on the
    head is not applied (a forward of hidden states through a weight has no per-input mask)."""
    head = model.get_output_embeddings()
    base = getattr(head, "base_layer", head)
    weight = base.weight
    if getattr(head, "lora_A", None) and not getattr(head, "merged", False) \
            and not getattr(head, "disable_adapters", False):
        for name in head.active_adapters:
            if name in head.lora_A:
                weight = weight + head.get_delta_weight(name).to(weight.dtype)
    return weight, base.bias


def tied_names(model: nn.Module) -> list[list[str]]:
    """Names of parameters shared under several names (tied input and output embeddings)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def with_tied(state: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` with every tied name present (``save_pretrained`` stores only one of them)."""
    out = dict(state)
    for names in tied_names(model):
        have = [n for n in names if n in out]
        if have:
            for n in names:
                out.setdefault(n, out[have[0]])
    return out


def own_names(state: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` (a saved folder's tensors) under ``model``'s own names. ``save_pretrained`` writes
    some architectures under their released checkpoint names (transformers' conversion mapping:
    Qwen2-VL's language model as ``model.*``, its vision tower as ``visual.*``, where the module
    holds ``model.language_model.*`` and ``model.visual.*``); those names are mapped back. A
    name the model has is kept as it is."""
    own = model.state_dict()
    if set(state) <= set(own):
        return dict(state)
    try:
        from transformers.core_model_loading import revert_weight_conversion
        saved = revert_weight_conversion(model, dict(own))  # own tensors under their saved names
    except (ImportError, AttributeError, TypeError, ValueError):  # transformers 4.x: names are saved as they are
        return dict(state)
    by_id = {id(v): k for k, v in own.items()}
    names = {s: s if s in own else by_id[id(v)] for s, v in saved.items() if s in own or id(v) in by_id}
    return {names.get(k, k): v for k, v in state.items()}


def tensors_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under each of its names (a tied weight under both)."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def cache_keyword(module: nn.Module) -> str | None:
    """The keyword through which ``module.forward`` takes a KV cache: ``cache`` (transformers
    >= 5.24, which deprecates the old name) or ``past_key_values`` (older releases); None if
    it takes neither. Passing the name the model expects keeps every forward free of
    deprecation warnings, whichever transformers a user has."""
    import inspect
    params = inspect.signature(module.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


def plain_kv_cache(model: nn.Module) -> bool:
    """Whether the model's KV cache is a ``DynamicCache`` of full-attention layers only (no
    sliding window, no recurrent state): one a caller may fill, select rows of and repeat."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
        layers = getattr(DynamicCache(config=model.config), "layers", None)
    except (ImportError, TypeError, AttributeError, ValueError):  # transformers 4.x, odd models
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def model_context(path: Path) -> int | None:
    """The number of positions the model at ``path`` can attend over (``max_position_embeddings``,
    GPT-2's ``n_positions``), or None when its config names none. Reads config.json only."""
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise RunError(f"could not read the model's config.json in {path}: {e}") from None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


#: config.json keys that give a mixture-of-experts model its number of routed experts
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def is_moe_config(config: dict[str, Any]) -> bool:
    """Whether a config.json (as a dict; a VLM's ``text_config`` too) declares routed experts."""
    parts = [config] + [v for k, v in config.items() if k.endswith("_config") and isinstance(v, dict)]
    return any(isinstance(p.get(k), int) and p.get(k, 0) > 1 for p in parts for k in EXPERT_KEYS)


def folder_is_moe(folder: str | Path) -> bool | None:
    """Whether the model folder's config.json declares experts; None when there is no config.json."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    return is_moe_config(json.loads(path.read_text()))


#: Module name prefixes of the vision tower in transformers' VLM classes.
VISION_PREFIXES = ("model.visual.", "visual.")


def freeze_vision(model: nn.Module) -> int:
    """``requires_grad=False`` on every vision-tower parameter (``model.freeze_vision``);
    returns how many parameters were frozen."""
    frozen = 0
    for name, p in model.named_parameters():
        if name.startswith(VISION_PREFIXES):
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen
