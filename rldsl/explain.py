"""``rldsl explain``: an algorithm slot by slot with formulas, and structural diffs.

Everything here reads the registry (formulas come from component docstrings) and the
resolved Algorithm; nothing is computed twice.
"""
from __future__ import annotations

from typing import Any

from . import registry
from .formula import hooks as formula_hooks
from .spec import Algorithm, SlotValue

# data-flow order of the slots in the objective
FLOW = ["rewards", "shaping", "baseline", "normalizer", "filter", "sampling", "ratio",
        "trust_region", "objective", "kl", "entropy", "aggregation", "critic"]


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "-" if v is None else str(v)


def _short(path: str) -> str:
    """A path relative to the working directory when it lies below it."""
    import os
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def provenance(algo: Algorithm, v: SlotValue) -> str:
    """Where a slot value comes from: ``file:line``, ``inherited from X (file:line)`` or ``default``."""
    if v.origin is None:
        return "default"
    loc = f"{_short(v.origin.file)}:{v.origin.line}"
    if v.origin.algorithm == algo.name and v.origin.file == algo.file:
        return loc
    return f"inherited from {v.origin.algorithm} ({loc})"


def slot_rows(algo: Algorithm) -> list[dict[str, Any]]:
    """One row per slot component: slot, component, params, formula (values substituted), source."""
    rows = []
    for slot in FLOW:
        for v in algo.slots[slot]:
            rows.append({
                "slot": slot, "component": v.component,
                "params": {k: x for k, x in v.params.items()},
                "formula": _formula(v),
                "source": formula_hooks.source(v) if v.formula is not None else
                registry.get(slot, v.component).source,
                "from": provenance(algo, v),
            })
    return rows


def _formula(v: SlotValue) -> str:
    """The slot value's formula with its parameters substituted (registry or spec formula)."""
    if v.formula is not None:
        return formula_hooks.text(v)
    return registry.get(v.slot, v.component).formula_with(v.params)


def objective_lines(algo: Algorithm) -> list[str]:
    """The whole objective as a chain of equations in data-flow order (params substituted)."""
    def f(slot: str) -> list[str]:
        return [_formula(v) for v in algo.slots[slot] if v.component != "none"]

    out: list[str] = []
    for s in f("shaping"):
        out.append(f"shaping:      {s}")
    kl = algo["kl"]
    if algo.kl_in == "reward":
        out.append(f"kl in reward: r_i -= {_fmt(kl.params['beta'])} * sum_t {kl.component}(pi_old, pi_ref)_t")
    out.append(f"baseline:     {f('baseline')[0] if f('baseline') else 'A_i = r_i'}")
    for s in f("normalizer"):
        out.append(f"normalizer:   {s}")
    for s in f("filter"):
        out.append(f"filter:       {s}")
    out.append(f"ratio:        {f('ratio')[0]}")
    tr = f("trust_region")
    out.append(f"trust region: {tr[0] if tr else 'w = rho'}")
    out.append(f"objective:    {f('objective')[0]}")
    extra = ""
    if algo.kl_in == "loss":
        out.append(f"kl:           {f('kl')[0]}")
        extra += f" + {_fmt(kl.params['beta'])} * {kl.component}_it"
    if algo.uses_entropy:
        out.append(f"entropy:      {f('entropy')[0]}")
        extra += f" - {_fmt(algo['entropy'].params['coef'])} * H_it"
    out.append(f"aggregation:  {f('aggregation')[0]}")
    out.append(f"minimised:    L(theta) = {algo['aggregation'].component}_it[ l_it{extra} ]")
    if algo.uses_critic:
        out.append(f"critic:       {f('critic')[0]}")
    return out


def to_dict(algo: Algorithm) -> dict[str, Any]:
    return {"name": algo.name, "description": algo.description, "file": algo.file,
            "extends": algo.extends, "slots": slot_rows(algo), "objective": objective_lines(algo)}


def diff(a: Algorithm, b: Algorithm) -> dict[str, Any]:
    """Slot by slot, parameter by parameter: what is the same and what differs, with provenance."""
    slots = []
    for slot in FLOW:
        va, vb = a.slots[slot], b.slots[slot]
        ca, cb = [v.component for v in va], [v.component for v in vb]
        entry: dict[str, Any] = {"slot": slot, "a": " + ".join(str(v) for v in va),
                                 "b": " + ".join(str(v) for v in vb),
                                 "a_from": provenance(a, va[0]), "b_from": provenance(b, vb[0])}
        spec_formula = formula_hooks.diff_slots(va, vb)
        if spec_formula is not None:  # a formula on either side: compared binding by binding
            entry.update(spec_formula)
        elif ca != cb:
            entry["status"] = "component differs"
        else:
            changes = []
            for x, y in zip(va, vb):
                for k in x.params:
                    if x.params[k] != y.params[k]:
                        changes.append({"param": f"{x.component}.{k}" if len(va) > 1 else k,
                                        "a": x.params[k], "b": y.params[k]})
            entry["status"] = "params differ" if changes else "same"
            if changes:
                entry["params"] = changes
        slots.append(entry)
    return {"a": a.name, "b": b.name, "a_file": _short(a.file), "b_file": _short(b.file),
            "a_extends": a.extends, "b_extends": b.extends, "slots": slots,
            "differences": sum(s["status"] != "same" for s in slots)}
