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
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from ..errors import RunError
from .vision import language_lora_targets

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
    if getattr(getattr(model, "config", None), "vision_config", None) is not None:  # a VLM: its language model only
        if targets == "all-linear":
            head = model.get_output_embeddings()
            targets = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                              if isinstance(m, nn.Linear) and m is not head and ".visual." not in f".{n}."})
        targets = language_lora_targets(model, targets)
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


def lora_scalings(model: nn.Module) -> dict[str, tuple[float, bool]]:
    """{LoRA module name: (scaling alpha / r, fan_in_fan_out)} of the active adapter: what
    :func:`merge_state` needs besides the tensors. Module names are unchanged by FSDP2's
    ``fully_shard`` (it swaps classes, not modules), so a sharded model answers too."""
    out: dict[str, tuple[float, bool]] = {}
    for name, layer in lora_layers(model).items():
        active = list(layer.active_adapters)
        if active != [ADAPTER] or ADAPTER not in getattr(layer, "lora_A", {}):
            raise RunError(f"LoRA layer {name}: only the single adapter {ADAPTER!r} of a linear "
                           f"layer is merged (found adapters {active})")
        out[name] = (float(layer.scaling[ADAPTER]), bool(getattr(layer, "fan_in_fan_out", False)))
    return out


@torch.no_grad()
def merge_state(state: Mapping[str, torch.Tensor],
                scalings: Mapping[str, tuple[float, bool]]) -> dict[str, torch.Tensor]:
    """A full state dict of a model with LoRA layers -> the plain model's state dict, adapters
    merged: for each LoRA module ``m``

        m.weight = m.base_layer.weight + scaling * (B @ A)     (B @ A transposed when fan_in_fan_out)

    computed in float32 (float64 stays float64) and cast back to the base weight's dtype;
    ``m.base_layer.bias`` becomes ``m.bias``. It is the formula of peft's ``get_delta_weight``
    that :func:`merged_weights` uses, on tensors instead of modules: the distributed trainer's
    gathered state dict has no LoRA modules behind it. A LoRA tensor left over raises.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" not in key:
            out[key.replace(".base_layer.", ".")] = value
    for name, (scaling, fan_in_fan_out) in scalings.items():
        w = out[f"{name}.weight"]
        a, b = state[f"{name}.lora_A.{ADAPTER}.weight"], state[f"{name}.lora_B.{ADAPTER}.weight"]
        work = torch.float64 if w.dtype == torch.float64 else torch.float32
        delta = b.to(work) @ a.to(work)
        if fan_in_fan_out:
            delta = delta.T
        out[f"{name}.weight"] = (w.to(work) + delta * scaling).to(w.dtype)
    known = {f"{n}.lora_{ab}.{ADAPTER}.weight" for n in scalings for ab in "AB"}
    left = [k for k in state if ".lora_" in k and k not in known]
    if left:
        raise RunError(f"LoRA tensors with no merge rule: {left[:3]} (only linear-layer "
                       f"adapters {ADAPTER!r} are merged)")
    return out


@contextlib.contextmanager
def adapters_disabled(wrapped: Any) -> Iterator[None]:
    """The base model's forward (the reference policy of a LoRA run): adapters off."""
    with wrapped.disable_adapter():
        yield
