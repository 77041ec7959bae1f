"""Resolved Algorithm -> readable Python source of ``advantages()`` and ``loss()``.

Only registry names (checked against the registry) and validated numeric / boolean
literals (or a registry's own choice strings) ever reach the templates; :func:`literal`
refuses anything else, so no text from a spec file can become code. The source is executed
in a closed namespace that holds torch, the per-slot component namespaces and two helpers,
and is registered with ``linecache`` so tracebacks and ``inspect.getsource`` show it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import linecache
import math
import re
from functools import lru_cache
from importlib import resources
from typing import Any, Callable

import jinja2
import torch

from . import ops, registry
from .formula import hooks as formula_hooks
from .spec import Algorithm, SlotValue

_IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")


class CodegenError(RuntimeError):
    """A value that must never reach generated code did (a bug, not a user error)."""


def literal(value: Any, choices: tuple[str, ...] = ()) -> str:
    """Python source for a validated parameter value; refuses anything that is not a plain literal."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CodegenError(f"non-finite literal {value!r}")
        return repr(float(value))
    if isinstance(value, str) and value in choices and _IDENT.fullmatch(value):
        return repr(value)
    raise CodegenError(f"refusing to emit {type(value).__name__} literal {value!r}")


def _name(slot: str, component: str) -> str:
    if component not in registry.REGISTRY.get(slot, {}) or not _IDENT.fullmatch(component):
        raise CodegenError(f"{slot}.{component} is not a registry name")
    return component


@dataclasses.dataclass(frozen=True)
class _Call:
    call: str   # the component's registry name
    args: str   # ", k=v, ..." with literals only
    where: str  # "slot component  spec line N"
    off: bool   # the component leaves its slot unused (a template may skip its line)
    code: str = ""  # a formula component: its generated lines (built from the checked tree only)


def _where(algo: Algorithm, v: SlotValue) -> str:
    if v.origin is None:
        return f"{v.slot} {v.component}  (default)"
    if v.origin.file == algo.file:
        return f"{v.slot} {v.component}  spec line {v.origin.line}"
    return f"{v.slot} {v.component}  inherited, parent spec line {v.origin.line}"


def _call(algo: Algorithm, v: SlotValue) -> _Call:
    if v.formula is not None:  # a component written in the spec
        if not _IDENT.fullmatch(v.component):
            raise CodegenError(f"{v.slot}.{v.component} is not an identifier")
        return _Call(v.component, "", _where(algo, v), False, formula_hooks.code(algo, v, _where(algo, v)))
    comp = registry.get(v.slot, v.component)
    args = "".join(f", {k}={literal(val, comp.params[k].choices)}"
                   for k, val in comp.fn_params(v.params).items())
    for k in comp.params:
        if not _IDENT.fullmatch(k):
            raise CodegenError(f"parameter name {k!r} is not an identifier")
    return _Call(_name(v.slot, v.component), args, _where(algo, v), comp.off)


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(
            lambda name: resources.files("rldsl").joinpath("templates", name).read_text("utf-8")),
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined, autoescape=False)


def _context(algo: Algorithm) -> dict[str, Any]:
    # every single-component slot with a function, by slot name: templates write {{ slot.call }}
    one = {s: _call(algo, algo[s]) for s, slot in registry.SLOTS.items()
           if slot.args is not None and not slot.multi}
    kl = algo["kl"]
    ctx: dict[str, Any] = dict(one)
    ctx["kl_in_loss"] = kl.stage == "loss" and not kl.spec.off
    ctx["kl_in_reward"] = kl.stage == "advantage" and not kl.spec.off
    ctx["kl_beta"] = literal(kl.params.get("beta")) if not kl.spec.off else "0.0"
    ctx["entropy_bonus"] = algo.uses_entropy
    # the baseline's optional inputs: extra arguments of advantages() (in this order) and of its batch
    needs = algo["baseline"].spec.facts.needs
    ctx["greedy_baseline"] = "reward_baselines" in needs
    ctx["sum_pi_squared"] = "sum_pi_squared" in needs  # with old_logprobs in the batch
    ctx["per_reward"] = "reward_components" in needs  # two extra arguments
    ctx["entropy_coef"] = "entropy_coef" in algo.needs("loss")  # an extra argument of loss()
    ctx["critic"] = one["critic"] if algo.uses_critic else None
    ctx["critic_coef"] = literal(algo["critic"].params.get("coef")) if algo.uses_critic else "0.0"
    ctx["critic_aggregation"] = None
    ctx["critic_shares_denominator"] = False
    if algo.uses_critic:
        name = algo["critic"].params["aggregation"]
        comp = registry.get("aggregation", name)
        defaults = {k: p.default for k, p in comp.params.items()}
        ctx["critic_aggregation"] = _Call(_name("aggregation", name), "".join(
            f", {k}={literal(v, comp.params[k].choices)}" for k, v in comp.fn_params(defaults).items()),
            f"critic aggregation {name}", comp.off)
        policy = algo["aggregation"]
        ctx["critic_shares_denominator"] = policy.component == name and comp.fn_params(policy.params) == \
            comp.fn_params(defaults)
    ctx["shaping"] = [_call(algo, v) for v in algo["shaping"] if not v.spec.off]
    ctx["filters"] = [_call(algo, v) for v in algo["filter"] if not v.spec.off]
    ctx["corrections"] = [_call(algo, v) for v in algo["correction"] if not v.spec.off]
    ctx["selections"] = [_call(algo, v) for v in algo["selection"] if not v.spec.off]
    ctx["old_from_rollout"] = algo.old_from_rollout  # fact: correction bypass
    # what the corrections compare with the engine: pi_old, or pi_theta (detached) under bypass
    ctx["correction_old"] = "logp.detach()" if algo.old_from_rollout else "old_logp"
    ctx["uses_ratio"] = algo.uses_ratio  # facts: objective uses_ratio, kl k3 ratio_weighted in the loss
    ctx["with_metrics"] = True
    return ctx


@dataclasses.dataclass(frozen=True)
class Generated:
    advantages_source: str
    loss_source: str                # with diagnostics (the default)
    loss_source_no_metrics: str     # the same loss without them: loss(..., metrics=False)

    @property
    def source(self) -> str:
        return self.advantages_source + "\n\n" + self.loss_source


def generate(algo: Algorithm) -> Generated:
    """The Python source of ``advantages()`` and ``loss()`` for ``algo``."""
    ctx = _context(algo)
    env = _env()
    loss = env.get_template("loss.py.j2")
    return Generated(env.get_template("advantages.py.j2").render(**ctx), loss.render(**ctx),
                     loss.render(**{**ctx, "with_metrics": False}))


def namespace() -> dict[str, Any]:
    """The closed namespace generated code runs in: torch, the slot namespaces, two helpers.

    Safety comes from what the code is made of (registry names and checked literals only),
    not from hiding builtins: torch's C functions import lazily through the caller's
    ``__builtins__``, so a stripped builtins dict breaks them.
    """
    ns: dict[str, Any] = {"torch": torch,
                          "ops": ops, "AdvantageBatch": ops.AdvantageBatch,
                          "dataclasses": dataclasses}
    ns.update(registry.namespaces())
    ns.update(formula_hooks.NAMESPACE)  # fx: the masked reductions formulas compile to
    return ns


def load_function(source: str, name: str) -> Callable[..., Any]:
    """Execute generated ``source`` in a closed namespace and return function ``name``.

    The source is registered with linecache under a unique file name so tracebacks show it.
    """
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    filename = f"rldsl-generated-{name}-{digest}.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    ns = namespace()
    code = compile(source, filename, "exec")
    exec(code, ns)  # noqa: S102 - source is generated from registry names and literals only
    return ns[name]
