"""The losses ``forward_backward`` serves: the Tinker client's built-in names, each a spec of the
language, and any spec by name or path (``loss_fn_config.rldsl_spec``).

Every loss is a compiled spec (``rldsl.compile``) called on the call's datums laid out as rows
[B, T] (right padded): the server writes no formula of its own. docs/tinker.md has each built-in
name's formula from Tinker's documentation beside its spec; tests/runtime/tinker/test_losses.py
checks each (loss and gradient) against the formula.

Tinker's built-in losses are sums over every position of every datum (no denominator), so their
specs aggregate with ``token_sum`` over all positions. A spec chosen with ``rldsl_spec`` keeps its
own aggregation; its mask is the datum's ``mask`` input when sent, else the sampled positions
(``logprobs`` or ``advantages`` non-zero: the cookbook zeroes both on the prompt), and a mean is
taken over the whole call's tokens (``denominator``), or over ``loss_fn_config.rldsl_denominator``
when the client sends one (a client that splits a batch into several calls).
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import rldsl
from rldsl.errors import SpecError
from rldsl.tinker import rows_loss

from ..errors import TinkerRefused

log = logging.getLogger("rldsl.tinker")

#: the Tinker names: (spec text with {placeholders}, the loss_fn_config keys and defaults, the
#: datum inputs it needs). Thresholds are Tinker's: the ratio's absolute bounds (0.8 = 1 - 0.2).
_COMMON = "  baseline none\n  normalizer none\n  kl none\n  aggregation token_sum\n"
BUILTIN: dict[str, tuple[str, dict[str, float], tuple[str, ...]]] = {
    "cross_entropy": ('algorithm tinker_cross_entropy\n  "-sum w log p"\n  objective reinforce\n'
                      '  trust_region none\n' + _COMMON, {}, ("target_tokens", "weights")),
    "importance_sampling": ('algorithm tinker_importance_sampling\n  "-sum rho A"\n  ratio token(clamp=80.0)\n'
                            '  objective ppo\n  trust_region none\n' + _COMMON, {},
                            ("target_tokens", "logprobs", "advantages")),
    "ppo": ('algorithm tinker_ppo extends grpo\n  "-sum min(rho A, clip(rho) A)"\n  ratio token(clamp=80.0)\n'
            '  trust_region clip(low={low}, high={high})\n' + _COMMON,
            {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, ("target_tokens", "logprobs", "advantages")),
    "cispo": ('algorithm tinker_cispo extends cispo\n  "-sum sg(clip(rho)) A log p"\n  ratio token(clamp=80.0)\n'
              '  trust_region truncate(low={low}, high={high})\n' + _COMMON,
              {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, ("target_tokens", "logprobs", "advantages")),
    "dro": ('algorithm tinker_dro extends dro\n  "-sum (A log p - beta/2 (log p - log q)^2)"\n'
            '  ratio token(clamp=80.0)\n  objective dro(beta={beta})\n' + _COMMON,
            {"beta": 0.05}, ("target_tokens", "logprobs", "advantages")),
    "gspo": ('algorithm tinker_gspo extends gspo\n  "GSPO-token: -sum min(s_t A, clip(s_t) A)"\n'
             '  ratio sequence(clamp=80.0)\n  trust_region clip(low={low}, high={high})\n' + _COMMON,
             {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, ("target_tokens", "logprobs", "advantages")),
}
#: names the client knows whose formula is not public: refused, saying why
REFUSED = {"stable_reinforce": "its formula is not published (it reads the sampler's stability records); "
                               "use ppo, cispo or any spec with loss_fn_config.rldsl_spec=NAME"}
#: slots that are the client's job under this API: a chosen spec's are ignored, with a warning
CLIENT_SLOTS = ("baseline", "normalizer", "filter", "shaping", "sampling")
SPEC_KEY, DENOMINATOR_KEY = "rldsl_spec", "rldsl_denominator"


@dataclass
class Loss:
    """A compiled loss and how to feed it: ``builtin`` (Tinker's layout: all positions, sums) or a
    spec (its own aggregation over the sampled positions)."""

    name: str
    compiled: Any
    builtin: bool
    adv_key: str
    needs: tuple[str, ...]
    ignored: tuple[str, ...] = ()
    reference: bool = False  # a KL term: the reference is the policy with its adapters off


def _number(config: dict[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if not isinstance(value, float | int):
        raise TinkerRefused(400, f"loss_fn_config[{key!r}] must be a number, got {value!r}")
    return float(value)


def _refuse_spec(exc: SpecError, what: str) -> TinkerRefused:
    return TinkerRefused(400, f"{what}: {exc.render() if hasattr(exc, 'render') else exc}")


@functools.lru_cache(maxsize=64)
def _compile(text: str, filename: str) -> Any:
    return rldsl.compile(rldsl.loads(text, filename), compile=False)


def _builtin(name: str, config: dict[str, Any]) -> Loss:
    text, defaults, needs = BUILTIN[name]
    unknown = sorted(set(config) - set(defaults) - {DENOMINATOR_KEY})
    if unknown:
        raise TinkerRefused(400, f"loss {name!r} takes no loss_fn_config {unknown} "
                                 f"(it takes {sorted(defaults) or 'none'})")
    values = {k: _number(config, k, d) for k, d in defaults.items()}
    fill = {}
    if "clip_low_threshold" in values:
        lo, hi = values["clip_low_threshold"], values["clip_high_threshold"]
        if not 0 < lo < 1 or hi <= 1:
            raise TinkerRefused(400, f"loss {name!r}: need 0 < clip_low_threshold < 1 < clip_high_threshold, "
                                     f"got {lo} and {hi}")
        fill = {"low": repr(1.0 - lo), "high": repr(hi - 1.0)}
    if "beta" in values:
        fill["beta"] = repr(values["beta"])
    try:
        compiled = _compile(text.format(**fill), f"<tinker loss {name}>")
    except SpecError as e:
        raise _refuse_spec(e, f"loss {name!r}") from None
    adv = "weights" if name == "cross_entropy" else "advantages"
    return Loss(name, compiled, True, adv, needs)


def _param_text(value: Any) -> str:
    return "true" if value is True else "false" if value is False else repr(value)


def _with_overrides(algo: Any, overrides: dict[str, float]) -> str:
    """A child spec of ``algo`` with ``slot.param=value`` set (as ``--set`` sets a run's keys)."""
    lines = [f"algorithm {algo.name}_tinker extends {algo.name}", '  "set by loss_fn_config"']
    by_slot: dict[str, dict[str, float]] = {}
    for key, value in overrides.items():
        slot, _, param = key.partition(".")
        if slot not in algo.slots or not param or len(algo.slots[slot]) != 1:
            raise TinkerRefused(400, f"loss_fn_config[{key!r}]: expected SLOT.PARAM of a slot of spec "
                                     f"{algo.name!r} (its slots: {sorted(algo.slots)})")
        by_slot.setdefault(slot, {})[param] = value
    for slot, params in by_slot.items():
        value = algo.slots[slot][0]
        merged = {**value.params, **params}
        args = ", ".join(f"{k}={_param_text(v)}" for k, v in merged.items() if v is not None)
        lines.append(f"  {slot} {value.component}({args})" if args else f"  {slot} {value.component}")
    return "\n".join(lines) + "\n"


def _spec(ref: str, config: dict[str, Any]) -> Loss:
    if not re.fullmatch(r"[\w./-]+", ref):
        raise TinkerRefused(400, f"loss_fn_config[{SPEC_KEY!r}]={ref!r} is neither a spec name nor a path")
    overrides = {k: _number(config, k, 0.0) for k in config if k not in (SPEC_KEY, DENOMINATOR_KEY)}
    try:
        algo = rldsl.load(ref)
        if overrides:
            where = Path(algo.file).parent / f"{algo.name}_tinker.rl" if Path(algo.file).exists() else "<string>"
            algo = rldsl.loads(_with_overrides(algo, overrides), str(where))
        compiled = rldsl.compile(algo, compile=False)
    except SpecError as e:
        raise _refuse_spec(e, f"loss_fn_config[{SPEC_KEY!r}]={ref!r}") from None
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise TinkerRefused(400, f"loss_fn_config[{SPEC_KEY!r}]={ref!r}: {e}") from None
    ignored = tuple(s for s in CLIENT_SLOTS if any(v.component not in ("none", "once") for v in algo.slots.get(s, [])))
    if ignored:
        log.warning("spec %s: slots %s are the client's job under the Tinker API (it sends the advantages): "
                    "ignored", algo.name, ", ".join(ignored))
    if algo.uses_critic or algo.uses_teacher:
        raise TinkerRefused(400, f"spec {algo.name!r} needs a critic or a teacher, which a forward_backward "
                                 "call does not carry: choose a spec without them")
    return Loss(algo.name, compiled, False, "advantages", ("target_tokens", "logprobs", "advantages"), ignored,
                bool(algo.uses_reference))


def resolve_loss(loss_fn: str, config: dict[str, Any]) -> Loss:
    """The loss for a call: ``loss_fn`` a Tinker name, or any name with ``rldsl_spec`` in the
    config (then the spec decides). A TinkerRefused (400) for an unknown or refused name."""
    ref = config.get(SPEC_KEY)
    if ref is not None:
        if not isinstance(ref, str):
            raise TinkerRefused(400, f"loss_fn_config[{SPEC_KEY!r}] must be a string (a spec name or path)")
        return _spec(ref, config)
    if loss_fn in REFUSED:
        raise TinkerRefused(400, f"loss {loss_fn!r} is not served: {REFUSED[loss_fn]}")
    if loss_fn not in BUILTIN:
        raise TinkerRefused(400, f"unknown loss {loss_fn!r}: served are {sorted(BUILTIN)}, or any rldsl spec "
                                 f"with loss_fn_config={{'{SPEC_KEY}': NAME_OR_PATH}}")
    return _builtin(loss_fn, config)


def check_inputs(loss: Loss, inputs: list[dict[str, Any]]) -> None:
    """Every datum carries what the loss reads (a 400 naming the first that does not)."""
    for i, d in enumerate(inputs):
        missing = [k for k in loss.needs if k not in d]
        if missing:
            raise TinkerRefused(400, f"loss {loss.name!r}: datum {i} lacks loss_fn_inputs {missing} "
                                     f"(it needs {list(loss.needs)})")


def compute(loss: Loss, logprobs: list[torch.Tensor], inputs: list[dict[str, Any]],
            denominator: float | None, reference: list[torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, dict[str, float]]:
    """(the scalar loss of the call, its metrics) for per-datum target logprobs (with gradient):
    ``rldsl.tinker.rows_loss``, the layout the client-side helper uses too."""
    return rows_loss(loss.compiled, logprobs, inputs, all_positions=loss.builtin, adv_key=loss.adv_key,
                     ratio_mask_key="sequence_ratio_mask" if loss.name == "gspo" else None,
                     denominator=denominator, reference=reference)
