"""LoRA through ``peft`` (extra ``rldsl[peft]``): adapters on the policy, merged weights for
the rollout engines and for export, the reference policy as the policy with adapters off; with
``model.lora.sync = "adapter"`` the adapters alone (:class:`LoraAdapter`) go to the engines.

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
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
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
    if isinstance(targets, list):  # names (not "all-linear", nor a VLM's language-model pattern, a str)
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
        with warnings.catch_warnings():  # peft reads model.is_gradient_checkpointing, which transformers 5
            warnings.filterwarnings(     # deprecates: a FutureWarning on every LoRA run's console, none of ours
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            # peft's own rank_pattern for a fused gate_up_proj (2r: gate and up in one) is applied to the
            # experts' parameter adapters, but its check matches module names only and calls it ignored
            warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match "
                                    r"any targeted module and were ignored: \['[^']*gate_up_proj'\]",
                                    category=RuntimeWarning)
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


# ----------------------------------------------------------------------------- adapters as adapters

@dataclass
class LoraAdapter:
    """The adapters alone (``model.lora.sync = "adapter"``): what the trainer sends to the rollout
    engines instead of merged weights, a few MB instead of the model. ``tensors``: the trainer's
    names (``<module>.lora_A.default.weight`` / ``lora_B``), CPU copies; ``rank`` / ``alpha``: the
    update is (alpha / rank) B A on every adapted module. :meth:`save` writes it as a peft adapter
    folder (what vLLM's ``LoRARequest`` loads); the HF engine copies the tensors into its own LoRA
    layers (:func:`load_adapter`)."""

    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: float

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def target_modules(self) -> list[str]:
        """The adapted modules' last name parts (``q_proj``, ...): peft's ``target_modules``."""
        return sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in self.tensors})

    def peft_config(self) -> dict[str, Any]:
        """peft's ``adapter_config.json`` of these adapters (plain LoRA: no rsLoRA, DoRA or bias)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "target_modules": self.target_modules(), "lora_dropout": 0.0, "bias": "none",
                "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
                "base_model_name_or_path": None, "inference_mode": True}

    def save(self, folder: str | os.PathLike) -> Path:
        """``folder`` as peft's ``save_pretrained`` writes it: ``adapter_config.json`` and
        ``adapter_model.safetensors`` (names ``base_model.model.<module>.lora_A.weight``)."""
        from safetensors.torch import save_file
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        named = {f"base_model.model.{k.replace(f'.{ADAPTER}.', '.')}": t.detach().contiguous()
                 for k, t in self.tensors.items()}
        save_file(named, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps(self.peft_config(), indent=2))
        return out


def adapter_shape(model: nn.Module) -> tuple[int, float]:
    """(rank, alpha) shared by every LoRA layer of ``model`` (a sharded model answers too);
    raises when the layers differ or an adapter is not a plain linear-layer LoRA."""
    seen: set[tuple[int, float]] = set()
    for name, layer in lora_layers(model).items():
        if list(layer.active_adapters) != [ADAPTER]:
            raise RunError(f"LoRA layer {name}: only the single adapter {ADAPTER!r} is sent "
                           f"(found adapters {list(layer.active_adapters)})")
        if getattr(layer, "fan_in_fan_out", False) or getattr(layer, "use_dora", {}).get(ADAPTER, False):
            raise RunError(f"LoRA layer {name}: model.lora.sync='adapter' sends plain linear-layer adapters "
                           "(no fan_in_fan_out / DoRA): use model.lora.sync='merged'")
        seen.add((int(layer.r[ADAPTER]), float(layer.lora_alpha[ADAPTER])))
    if len(seen) != 1:
        raise RunError(f"model.lora.sync='adapter' needs one rank and alpha on every LoRA layer (found {sorted(seen)})")
    return seen.pop()


def adapter_of(model: nn.Module, state: Mapping[str, torch.Tensor] | None = None) -> LoraAdapter:
    """The adapters of ``model`` (its LoRA layers' tensors, CPU copies), or those of ``state``
    -- a full state dict gathered from ``model``'s shards -- when given."""
    rank, alpha = adapter_shape(model)
    source = model.state_dict() if state is None else state
    tensors = {k: v.detach().to("cpu", copy=True) for k, v in source.items() if ".lora_" in k}
    if not tensors:
        raise RunError("model.lora.sync='adapter': the policy has no LoRA tensors")
    return LoraAdapter(tensors, rank, alpha)


@torch.no_grad()
def load_adapter(model: nn.Module, adapter: LoraAdapter) -> None:
    """Copy ``adapter`` into ``model``'s LoRA layers, injecting them first (frozen, peft's
    ``get_peft_model`` with the adapter's rank, alpha and modules) when it has none: a rollout
    engine's own copy of the policy then computes base + adapters as the trainer does."""
    if not lora_layers(model):
        apply_lora(model, rank=adapter.rank, alpha=adapter.alpha, dropout=0.0,
                   target_modules=adapter.target_modules())
        model.requires_grad_(False)
    targets = dict(model.named_parameters())
    missing = sorted(set(adapter.tensors) - set(targets))
    if missing:
        raise RunError(f"the engine's model has no LoRA tensor {missing[0]!r} ({len(missing)} missing): "
                       "the adapters were made for another model")
    for name, t in adapter.tensors.items():
        if targets[name].shape != t.shape:
            raise RunError(f"LoRA tensor {name!r} has shape {tuple(t.shape)}, the engine's "
                           f"{tuple(targets[name].shape)}: the adapters' rank changed")
        targets[name].copy_(t.to(device=targets[name].device, dtype=targets[name].dtype))
