"""Resolved Algorithm -> readable Python source of ``advantages()`` and ``loss()``.

Only registry names (checked against the registry) and validated numeric / boolean
literals (or a registry's own choice strings) ever reach the templates; ``generated.literal``
refuses anything else, so no text from a spec file can become code. The generated functions'
optional arguments come from the inputs table (``rldsl/inputs.py``): an input the algorithm
reads is an argument, one it does not read is not. ``generated.load_function`` runs the source.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from importlib import resources
from typing import Any

import jinja2

from . import inputs, ops, registry
from .formula import hooks as formula_hooks
from .generated import IDENT, CodegenError, literal
from .spec import Algorithm
from .values import SlotValue

#: a line of the generated batch construction wraps before a group of fields that would pass it
_BATCH_LINE = 100
_BATCH_INDENT = " " * 27  # under ``AdvantageBatch(``
_BATCH_FIELDS = {f.name for f in dataclasses.fields(ops.AdvantageBatch)}


def _name(slot: str, component: str) -> str:
    if component not in registry.REGISTRY.get(slot, {}) or not IDENT.fullmatch(component):
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


def _literal_choices(p: registry.Param, value: object) -> tuple[str, ...]:
    """The strings a parameter's literal may be: its choices, or the field a ``field`` one names
    (checked a name by the spec checker; ``literal`` refuses any non-identifier). A ``field``
    parameter not given is left out of the call (the function's default None), so the code of
    a spec without ``group_by`` is what it was."""
    return (value,) if p.kind == "field" and isinstance(value, str) else p.choices


def _call(algo: Algorithm, v: SlotValue) -> _Call:
    if v.formula is not None:  # a component written in the spec
        if not IDENT.fullmatch(v.component):
            raise CodegenError(f"{v.slot}.{v.component} is not an identifier")
        return _Call(v.component, "", _where(algo, v), False,
                     formula_hooks.code(algo.slots[v.slot], v, _where(algo, v)))
    comp = registry.get(v.slot, v.component)
    args = "".join(f", {k}={literal(val, _literal_choices(comp.params[k], val))}"
                   for k, val in comp.fn_params(v.params).items()
                   if val is not None or comp.params[k].kind != "field")  # no group_by: code unchanged
    if registry.SLOTS[v.slot].keyword_inputs:  # the inputs it reads, as keywords
        for x in comp.facts.needs:
            arg = inputs.INPUTS[x].arg
            if not IDENT.fullmatch(arg):
                raise CodegenError(f"input argument {arg!r} is not an identifier")
            args += f", {arg}={arg}"
    for k in comp.params:
        if not IDENT.fullmatch(k):
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
    # a rewards declaration that reads an input (`rewards dense`): the token rewards come from it
    dense = [inputs.INPUTS[x].arg for x in algo["rewards"].spec.facts.needs]
    if dense and not IDENT.fullmatch(dense[0]):
        raise CodegenError(f"input argument {dense[0]!r} is not an identifier")
    ctx["rewards_input"] = dense[0] if dense else None
    ctx["rewards_where"] = _where(algo, algo["rewards"])
    ctx.update(_distill_context(algo))
    # the optional inputs the algorithm reads: extra arguments of advantages() / loss() (the
    # inputs table's order), and the AdvantageBatch fields they fill
    for stage in inputs.STAGES:
        ctx[f"{stage}_args"] = [i.arg for i in extra_inputs(algo, stage)]
    ctx["batch_fields"] = _batch_fields(algo)
    # an entropy component reading the algorithm's own state (a coefficient) is scaled by it
    ent = algo["entropy"]
    state = [inputs.INPUTS[x].arg for x in ent.spec.facts.needs if inputs.INPUTS[x].source == "algorithm"]
    ctx["entropy_scale"] = state[0] if state and ent.formula is None else None
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
    ctx["kl_aggregation"] = _term_aggregation(algo) if ctx["kl_in_loss"] else None
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


def _term_aggregation(algo: Algorithm) -> _Call | None:
    """The KL term's own aggregation (kl ``aggregation=NAME``, per-term aggregation), at its
    parameters' defaults; None: the term joins the per-token loss of the aggregation slot."""
    name = algo["kl"].params.get("aggregation")
    if name is None:
        return None
    comp = registry.get("aggregation", name)
    defaults = {k: p.default for k, p in comp.params.items()}
    return _Call(_name("aggregation", name), "".join(
        f", {k}={literal(v, comp.params[k].choices)}" for k, v in comp.fn_params(defaults).items()),
        f"kl aggregation={name}", comp.off)


def _distill_context(algo: Algorithm) -> dict[str, Any]:
    """How the distill slot's divergence enters the loss (its runtime parameters; see
    rldsl/components/distill.py): the template's ``distill_*`` names."""
    d = algo["distill"]
    if d.spec.off or d.formula is not None:
        return {"distill_on": False, "distill_task": True}
    p = d.params
    return {"distill_on": True, "distill_task": algo.task_loss,
            "distill_pg": p["mode"] == "policy_gradient", "distill_coef": literal(p["coef"]),
            "distill_max_clamp": None if p["max_clamp"] is None else literal(p["max_clamp"]),
            "distill_low": literal(p["clip_low"]), "distill_high": literal(p["clip_high"]),
            "distill_c": literal(p["clip_c"])}


def extra_inputs(algo: Algorithm, stage: str) -> list[inputs.Input]:
    """The optional inputs the generated function of ``stage`` takes after its fixed arguments,
    in order: those an active component reads, and those its slot passes to every component."""
    passed = [a for v in algo.active(stage) for a in registry.SLOTS[v.slot].args or ()]
    return inputs.extra_args(stage, algo.needs(stage), passed)


def _batch_fields(algo: Algorithm) -> list[str]:
    """``, field=arg`` of the AdvantageBatch fields the advantage-stage components that receive the
    batch read (inputs
    with a ``batch`` field not always filled), grouped by component, wrapped at _BATCH_LINE."""
    groups: list[str] = []
    seen: set[str] = set()
    for v in algo.active("advantage"):
        if "batch" not in (registry.SLOTS[v.slot].args or ()):
            continue  # its slot passes what it reads as arguments (kl in the reward)
        fields = [i for i in map(inputs.INPUTS.__getitem__, v.spec.facts.needs)
                  if i.batch and i.name not in seen]
        seen.update(i.name for i in fields)
        own = [f"{i.batch}={i.arg}" for i in fields if i.batch in _BATCH_FIELDS]
        other = [f"{i.batch}={i.arg}" for i in fields if i.batch not in _BATCH_FIELDS]  # batch.inputs
        if own or other:
            groups.append(", ".join(own + ([f"inputs=dict({', '.join(other)})"] if other else [])))
    out: list[str] = []
    line = len(_BATCH_INDENT) + len("valid=valid")
    for g in groups:
        if line + 2 + len(g) + 1 > _BATCH_LINE:
            out.append(",\n" + _BATCH_INDENT + g)
            line = len(_BATCH_INDENT) + len(g)
        else:
            out.append(", " + g)
            line += 2 + len(g)
    return out


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
