"""Where formulas meet the rest of rldsl: the spec checker, the code generator, the compiled
algorithm and ``explain`` each call one function here, so the formula language stays in
this package.

A formula fills a slot like a registry component: its ``SlotValue`` has the define's name
as ``component``, the resolved parameters as ``params`` and the checked :class:`Formula`
as ``formula``; the generated code holds its lines where the component call would be.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable

from .. import registry
from ..errors import ErrorList, Span
from ..suggest import close_matches
from . import emit, lang, masked
from .check import Formula, check_use
from .nodes import Define
from .render import binding as render_binding
from .render import render

if TYPE_CHECKING:  # pragma: no cover
    from ..parser import ComponentNode, SpecFile
    from ..spec import Algorithm, SlotValue

_DEFINE_NAME = re.compile(r"[a-z][a-z0-9_]*")
RESERVED = {"none", "formula", "define", "end"}

# ---------------------------------------------------------------------------------------
# spec.check_file


def defines(spec: "SpecFile", errors: ErrorList) -> dict[str, Define]:
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
    return out


def misspelt(cname: str, defs: dict[str, Define]) -> list[str]:
    """The defines a slot line's unknown component name is a typo of (did-you-mean)."""
    return close_matches(cname, defs) if cname not in defs else []


def slot_value(slot: str, node: "ComponentNode", define: Define, algorithm: str, file: str,
               errors: ErrorList, reported: set[tuple[str, Span]]) -> "SlotValue | None":
    """Check ``define`` as the component of ``slot`` (the slot line is ``node``)."""
    from ..spec import SlotValue, _origin
    f = check_use(slot, define, node.args, node.name.span, file, errors, reported)
    if f is None:
        return None
    origins = {a.name.text: _origin(algorithm, a.name.span) for a in node.args}
    return SlotValue(slot=slot, component=define.name, params=dict(f.params),
                     origin=_origin(algorithm, node.name.span), param_origins=origins, formula=f)


def unused(defs: dict[str, Define], used: set[str], errors: ErrorList) -> None:
    for name, d in defs.items():
        if name not in used:
            errors.add(f"define '{name}' is not used by any slot", d.name_span,
                       hint=f"fill a slot with it, e.g. `trust_region {name}`, or remove it")


# ---------------------------------------------------------------------------------------
# Facts: what the registry declares for its components, derived from the checked formula

# formula inputs -> the optional inputs (registry.INPUTS) of estimate()/loss() they come from
_NEEDS = {"ref_logp": "ref_logprobs", "rollout_logp": "rollout_logprobs", "ent": "entropy"}


def facts(f: Formula) -> registry.Facts:
    """The :class:`registry.Facts` of a checked formula, from what it reads and binds.

    needs: the optional inputs behind the names it reads (ref_logp, rollout_logp, ent) and
    group_size when it reads G or a group reduction; uses_ratio: it reads rho or w (a
    ratio or trust-region formula makes them instead); sequence_level: a ratio formula
    whose log_rho is one value per sequence; per_token_only: a trust region that reads rho
    together with the per-token logp or old_logp (a per-token divergence on the ratio; one
    that reads logp without rho builds its own ratio, as GMPO); never off, provides nothing."""
    needs = [_NEEDS[x] for x in _NEEDS if x in f.reads]
    if f.uses_groups:
        needs.append("group_size")
    seq = f.slot == "ratio" and f.typed[f.outputs[0]].rank < 2
    return registry.Facts(needs=tuple(needs),
                          uses_ratio=not f.spec.makes_ratio and f.reads_any("w", "rho"),
                          sequence_level=seq,
                          per_token_only=f.slot == "trust_region" and "rho" in f.reads
                          and f.reads_any("logp", "old_logp"))


def component(v: "SlotValue") -> registry.Component:
    """The registry entry a formula slot value answers with (``SlotValue.spec``): its
    parameters as floats with the define's defaults, its formula and source for explain, and
    the facts derived by :func:`facts`. No function: the generated code holds its lines."""
    f: Formula = v.formula
    hit = f.__dict__.get("_component")  # built once per checked formula, kept with it
    if hit is not None:
        return hit
    params = {k: registry.Float(d, f"a parameter of define {f.name}") for k, d in f.defaults.items()}
    outs = ", ".join(f"{o.name} {lang.SHAPES[o.rank]}" for o in f.spec.outputs if o.name in f.outputs)
    sections = {"formula": text(v), "source": source(v),
                "shapes": f"reads {', '.join(sorted(f.reads)) or 'no input'}; binds {outs}"}
    comp = registry.Component(v.slot, f.name, None, params, f"formula {f.name}, written in the spec",
                              sections, facts(f), frozenset(registry.SLOTS[v.slot].declares))
    object.__setattr__(f, "_component", comp)  # a cache on a frozen dataclass
    return comp


# ---------------------------------------------------------------------------------------
# codegen and compiled


def code(algo: "Algorithm", v: "SlotValue", where: str) -> str:
    """The formula's lines, indented for the template (the first line's indent is the template's)."""
    f: Formula = v.formula
    values = algo.slots[v.slot]
    prefix = f.spec.prefix + (str(values.index(v) + 1) if len(values) > 1 else "")
    return "\n    ".join(emit.lines(f, where, prefix))


_DENOMINATORS: dict[str, Callable[..., Any]] = {}


def denominator(algo: "Algorithm", mask: Any, group_size: int) -> Any:
    """The count of an aggregation formula for ``mask`` (what ``fn.denominator`` returns)."""
    from ..codegen import load_function
    v = algo["aggregation"]
    body = "\n    ".join(emit.lines(v.formula, f"aggregation {v.component}"))
    source = ("def denominator(mask, group_size):\n"
              "    mask = mask.to(torch.float32)\n"
              f"    {body}\n"
              "    return torch.as_tensor(count, dtype=mask.dtype)\n")
    if source not in _DENOMINATORS:
        _DENOMINATORS[source] = load_function(source, "denominator")
    return _DENOMINATORS[source](mask, group_size)


NAMESPACE = {"fx": masked}


def function(v: "SlotValue") -> Callable[..., dict[str, Any]]:
    """The formula of slot value ``v`` as a plain function (see :func:`emit.function_source`)."""
    from ..codegen import load_function
    return load_function(emit.function_source(v.formula), "formula")


# ---------------------------------------------------------------------------------------
# explain


def text(v: "SlotValue", values: bool = True) -> str:
    """A formula slot as one line: its outputs, then the bindings they use (parameters
    replaced by their values unless ``values`` is False)."""
    f: Formula = v.formula
    subs = f.params if values else {}
    by_name = {b.name: b for b in f.define.bindings}
    outs = [render_binding(by_name[o], subs) for o in f.outputs]
    rest = [render_binding(by_name[n], subs) for n in f.order if n not in f.outputs]
    return ";  ".join(outs) + (",  with " + ";  ".join(rest) if rest else "")


def source(v: "SlotValue") -> str:
    f: Formula = v.formula
    return f"formula, define {f.name} ({f.file}:{f.define.name_span.line})"


def bindings(v: "SlotValue") -> dict[str, str]:
    """Each computed binding as text, parameters by name (what a formula-vs-formula diff compares)."""
    f: Formula = v.formula
    by_name = {b.name: b for b in f.define.bindings}
    return {n: render(by_name[n].expr) for n in f.order}


def diff_slots(va: list["SlotValue"], vb: list["SlotValue"]) -> dict[str, Any] | None:
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


def diff_slot(va: "SlotValue", vb: "SlotValue") -> dict[str, Any] | None:
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
