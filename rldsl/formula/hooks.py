"""Where formulas meet the rest of rldsl: the spec checker, the code generator, the compiled
algorithm and ``explain`` each call one function here, so the formula language stays in
this package.

A formula fills a slot like a registry component: its ``SlotValue`` has the define's name
as ``component``, the resolved parameters as ``params`` and the checked :class:`Formula`
as ``formula``; the generated code holds its lines where the component call would be.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from .. import registry
from ..errors import ErrorList, Span
from ..suggest import close_matches
from ..generated import load_function
from ..parser import ComponentNode, SpecFile
from ..values import Origin, SlotValue
from . import component as formula_component
from . import emit, functions
from .check import GROUP_BY, Formula, check_use
from .nodes import Define
from .render import render

_DEFINE_NAME = re.compile(r"[a-z][a-z0-9_]*")
RESERVED = {"none", "formula", "define", "end"}

# ---------------------------------------------------------------------------------------
# spec.check_file


def defines(spec: SpecFile, errors: ErrorList) -> dict[str, Define]:
    """The file's defines by name; bad or duplicate names are errors (and left out)."""
    out: dict[str, Define] = {}
    taken = {c: s for s, comps in registry.REGISTRY.items() for c in comps}
    for d in spec.defines:
        if not _DEFINE_NAME.fullmatch(d.name):
            low = d.name.lower()
            errors.add(f"define name '{d.name}' must start with a lower case letter, then lower case "
                       "letters, digits or '_'", d.name_span,
                       hint=f"e.g. {low!r}" if _DEFINE_NAME.fullmatch(low) else None)
        elif d.name in out:
            first = out[d.name].name_span
            errors.add(f"define '{d.name}' is given twice", d.name_span, hint=f"first given at line {first.line}")
        elif d.name in taken or d.name in RESERVED or d.name in registry.SLOTS:
            what = (f"a {taken[d.name]} component" if d.name in taken else
                    "a slot" if d.name in registry.SLOTS else "a reserved word")
            errors.add(f"define '{d.name}' has the name of {what}", d.name_span,
                       hint="give the formula its own name")
        else:
            out[d.name] = d
    fns = functions.table(spec.functions, errors)
    for name in sorted(set(fns) - functions.used(out, fns), key=lambda n: fns[n].name_span.line):
        errors.add(f"function '{name}' is not called by any formula", fns[name].name_span,
                   hint="call it in a define block, or remove it")
    return {name: functions.expand(d, fns, errors) for name, d in out.items()}


def misspelt(cname: str, defs: dict[str, Define]) -> list[str]:
    """The defines a slot line's unknown component name is a typo of (did-you-mean)."""
    return close_matches(cname, defs) if cname not in defs else []


def slot_value(slot: str, node: ComponentNode, define: Define, algorithm: str, file: str,
               errors: ErrorList, reported: set[tuple[str, Span]]) -> SlotValue | None:
    """Check ``define`` as the component of ``slot`` (the slot line is ``node``)."""
    f = check_use(slot, define, node.args, node.name.span, file, errors, reported)
    if f is None:
        return None
    origins = {a.name.text: Origin.at(algorithm, a.name.span) for a in node.args}
    params: dict = dict(f.params)
    if f.group_by is not None:
        params[GROUP_BY] = f.group_by
    return SlotValue(slot=slot, component=define.name, params=params,
                     origin=Origin.at(algorithm, node.name.span), param_origins=origins, formula=f)


def unused(defs: dict[str, Define], used: set[str], errors: ErrorList) -> None:
    for name, d in defs.items():
        if name not in used:
            errors.add(f"define '{name}' is not used by any slot", d.name_span,
                       hint=f"fill a slot with it, e.g. `trust_region {name}`, or remove it")


# ---------------------------------------------------------------------------------------
# codegen and compiled


def code(values: list[SlotValue], v: SlotValue, where: str) -> str:
    """The formula's lines, indented for the template (the first line's indent is the template's);
    ``values``: every value of its slot (a multi-component slot numbers its formulas)."""
    f: Formula = v.formula
    prefix = f.spec.prefix + (str(values.index(v) + 1) if len(values) > 1 else "")
    return "\n    ".join(emit.lines(f, where, prefix))


_DENOMINATORS: dict[str, Callable[..., Any]] = {}


def denominator(v: SlotValue, mask: Any, group_size: int) -> Any:
    """The count of aggregation formula ``v`` for ``mask`` (what ``fn.denominator`` returns)."""
    body = "\n    ".join(emit.lines(v.formula, f"aggregation {v.component}"))
    source = ("def denominator(mask, group_size):\n"
              "    mask = mask.to(torch.float32)\n"
              f"    {body}\n"
              "    return torch.as_tensor(count, dtype=mask.dtype)\n")
    if source not in _DENOMINATORS:
        _DENOMINATORS[source] = load_function(source, "denominator")
    return _DENOMINATORS[source](mask, group_size)


def batch_wide_loss(slots: dict[str, list[SlotValue]]) -> list[str]:
    """The loss-stage slots (of an algorithm's ``slots``) holding a formula that reads a
    ``batch_*`` function: their values depend on every row one ``loss()`` call receives, so they
    are statistics of the whole batch only when the runtime gives ``loss()`` the whole batch in
    one call (docs/formulas.md, "Order operations")."""
    return [slot for slot, values in slots.items() for v in values
            if v.formula is not None and v.formula.spec.stage == "loss" and v.formula.batch_wide]


def function(v: SlotValue) -> Callable[..., dict[str, Any]]:
    """The formula of slot value ``v`` as a plain function (see :func:`emit.function_source`)."""
    return load_function(emit.function_source(v.formula), "formula")


# ---------------------------------------------------------------------------------------
# explain


def component(v: SlotValue) -> registry.Component:
    """The registry entry a formula slot value answers with (``SlotValue.spec``)."""
    return formula_component.component(v.formula)


def text(v: SlotValue, values: bool = True) -> str:
    """A formula slot as one line (see :func:`component.text`)."""
    return formula_component.text(v.formula, values)


def bindings(v: SlotValue) -> dict[str, str]:
    """Each computed binding as text, parameters by name (what a formula-vs-formula diff compares);
    a search that binds several names is one entry, named ``a, b`` as its line."""
    f: Formula = v.formula
    by_name = {b.name: b for b in f.define.bindings}
    return {", ".join(by_name[n].names): render(by_name[n].expr) for n in f.order}


def diff_slots(va: list[SlotValue], vb: list[SlotValue]) -> dict[str, Any] | None:
    """The diff of a slot's components where either side has a formula (None: neither has).

    A multi-component slot (shaping, filter) is compared pair by pair when both list the
    same components; its parameters are then named ``component.param``."""
    if all(v.formula is None for v in va + vb):
        return None
    if len(va) == 1 and len(vb) == 1:
        return diff_slot(va[0], vb[0])
    if [v.component for v in va] != [v.component for v in vb]:
        return {"status": "component differs"}
    entries = [diff_slot(x, y) or {"status": "same" if x.params == y.params else "params differ",
                                   "params": [{"param": k, "a": x.params[k], "b": y.params[k]}
                                              for k in x.params if x.params[k] != y.params[k]]}
               for x, y in zip(va, vb)]
    out: dict[str, Any] = {"status": next((s for s in ("formula differs", "params differ")
                                           if any(e["status"] == s for e in entries)), "same")}
    params = [{**p, "param": f"{x.component}.{p['param']}"} for x, e in zip(va, entries) for p in e.get("params", [])]
    bindings = [{**b, "binding": f"{x.component}.{b['binding']}"} for x, e in zip(va, entries)
                for b in e.get("bindings", [])]
    if params:
        out["params"] = params
    if bindings:
        out["bindings"] = bindings
    return out


def diff_slot(va: SlotValue, vb: SlotValue) -> dict[str, Any] | None:
    """The diff of a slot where either side is a formula (None: neither is)."""
    fa, fb = va.formula, vb.formula
    if fa is None and fb is None:
        return None
    entry: dict[str, Any] = {}
    names = list(va.params) + [k for k in vb.params if k not in va.params]
    params = [{"param": k, "a": va.params.get(k), "b": vb.params.get(k)} for k in names
              if va.params.get(k) != vb.params.get(k)]
    if fa is not None and fb is not None:
        ba, bb = bindings(va), bindings(vb)
        changed = [{"binding": k, "a": ba.get(k), "b": bb.get(k)}
                   for k in list(ba) + [k for k in bb if k not in ba] if ba.get(k) != bb.get(k)]
        same_params = set(fa.defaults) == set(fb.defaults)
        if changed or not same_params:
            entry["status"] = "formula differs"
            entry["bindings"] = changed
        else:
            entry["status"] = "params differ" if params else "same"
    else:
        entry["status"] = "component differs"
        entry["a_formula"] = text(va) if fa is not None else registry.get(va.slot, va.component).formula_with(va.params)
        entry["b_formula"] = text(vb) if fb is not None else registry.get(vb.slot, vb.component).formula_with(vb.params)
    if params:
        entry["params"] = params
    return entry
