"""LoRA through ``peft`` (extra ``rldsl[peft]``): adapters on the policy, merged weights for
the rollout engines and for export, the reference policy as the policy with adapters off.

The trainer keeps the plain transformers model (``PeftModel.get_base_model()``): peft
replaces each targeted ``nn.Linear`` in place by a LoRA layer (``base_layer`` + ``lora_A`` /
``lora_B``), so the model's own forward trains only the adapters; the base weights are
frozen. Checkpoints hold that model's state (base and adapter tensors) and resume exactly.

    W_merged = W + (alpha / r) * B @ A          (peft's ``get_delta_weight``; no rsLoRA)
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from .errors import RunError

ADAPTER = "default"


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise RunError("model.lora needs the peft package: pip install 'rldsl[peft]'") from None
    return peft


def apply_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float,
               target_modules: list[str] | str) -> tuple[nn.Module, Any]:
    """(the model with LoRA layers injected -- trainable adapters, frozen base --, its
    ``PeftModel`` wrapper, kept for ``disable_adapter``)."""
    peft = require_peft()
    targets: Any = "all-linear" if target_modules in ("all-linear", ["all-linear"]) else list(target_modules)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                             task_type="CAUSAL_LM")
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        raise RunError(f"model.lora: {e}") from None
    return wrapped.get_base_model(), wrapped


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The LoRA layers of a model by module name (empty for a plain model)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under the plain model's names, adapters merged into their base
    weights (``W + (alpha/r) B A``), no LoRA tensor left: what an engine or an export loads.
    A model without LoRA layers gives its ``state_dict``."""
    state = model.state_dict()
    layers = lora_layers(model)
    if not layers:
        return dict(state)
    out = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    for name, layer in layers.items():
        key = f"{name}.weight"
        delta = sum((layer.get_delta_weight(a) for a in layer.active_adapters), torch.zeros_like(out[key]))
        out[key] = out[key] + delta.to(out[key].dtype)
    return out


@contextlib.contextmanager
def adapters_disabled(wrapped: Any) -> Iterator[None]:
    """The base model's forward (the reference policy of a LoRA run): adapters off."""
    with wrapped.disable_adapter():
        yield
