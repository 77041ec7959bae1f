"""LoRA through ``peft`` (extra ``rldsl[peft]``): adapters on the policy, merged weights for
the rollout engines and for export, the reference policy as the policy with adapters off.

The trainer keeps the plain transformers model (``PeftModel.get_base_model()``): peft
replaces each targeted ``nn.Linear`` in place by a LoRA layer (``base_layer`` + ``lora_A`` /
``lora_B``), so the model's own forward trains only the adapters; the base weights are
frozen. Checkpoints hold that model's state (base and adapter tensors) and resume exactly.

    W_merged = W + (alpha / r) * B @ A          (peft's ``get_delta_weight``; no rsLoRA)

A mixture-of-experts model of transformers 5 holds each sparse layer's experts fused, as 3-D
parameters of one module (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), not
as Linear layers. A ``target_modules`` name that is such a parameter's (``gate_up_proj``,
``down_proj``) adapts it through peft's ``target_parameters`` (a ``ParamWrapper``: one LoRA pair
of rank r per expert, its delta ``get_delta_weight`` [E, ...]); its merge is done by the module
(:func:`merged_weights`, one process) -- the tensor formula of :func:`merge_state`, which the
FSDP2 trainers' sync uses, covers Linear adapters only.
"""
from __future__ import annotations

import contextlib
import re
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
    params: list[str] = []
    if targets != "all-linear":
        params = fused_expert_parameters(model, targets)
        linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        names = {p.rsplit(".", 1)[-1] for p in params}
        targets = [t for t in targets if t not in names or t in linear] or None
        if params and dropout:
            raise RunError(f"model.lora.dropout={dropout}: LoRA on fused expert parameters ({sorted(names)}) "
                           "has no dropout in peft (its update is folded into the weights): set it to 0")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                             target_parameters=params or None, task_type="CAUSAL_LM")
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        raise RunError(f"model.lora: {e}") from None
    return wrapped.get_base_model(), wrapped


def fused_expert_parameters(model: nn.Module, names: list[str]) -> list[str]:
    """The full names of the 3-D parameters (fused experts, ``experts.gate_up_proj``) of
    ``model`` whose own name is one of ``names``: the ``target_parameters`` they make."""
    return [f"{m_name}.{p_name}" for m_name, m in model.named_modules() if not isinstance(m, nn.Linear)
            for p_name, p in m.named_parameters(recurse=False) if p.ndim == 3 and p_name in names]


def _plain_name(key: str) -> str:
    """A state-dict key of a model with LoRA layers under the plain model's name (every
    ``base_layer`` level dropped: fused-expert adapters nest one per parameter)."""
    return re.sub(r"(\.base_layer)+\.", ".", key)


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
    out = {_plain_name(k): v for k, v in state.items() if ".lora_" not in k}
    for name, layer in layers.items():
        # a Linear's weight, or the fused-expert parameter a ParamWrapper adapts
        key = _plain_name(f"{name}.{getattr(layer, 'parameter_name', 'weight')}")
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
        if getattr(layer, "parameter_name", None) is not None:
            raise RunError(f"LoRA on the fused expert parameter {_plain_name(name + '.' + layer.parameter_name)}: "
                           "its adapters are merged in one process only, not by the FSDP2 trainers' sync "
                           "(distributed.trainers > 1): adapt the attention / Linear layers, or train in one "
                           "process")
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
