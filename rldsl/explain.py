"""``rldsl explain``: an algorithm slot by slot with formulas, and structural diffs.

Everything here reads the registry (formulas from component docstrings, the slot order
from ``registry.SLOTS``, what a component needs from its facts) and the resolved
Algorithm; nothing is computed twice. The text renderers return lines of literal
``(text, style)`` segments: no text is ever read as markup, and no line is cut or
wrapped to a width, so the output reads the same in a terminal, a pager or a file.
"""
from __future__ import annotations

import os
from typing import Any

from . import registry
from .formula import hooks as formula_hooks
from .inputs import INPUTS
from .priority import ReplayPolicy
from .registry import format_value
from .spec import Algorithm
from .values import SlotValue

Segment = tuple[str, str]  # (literal text, rich style or "")
Line = list[Segment]

SLOT_WIDTH = max(len(s) for s in registry.SLOTS)
MARKS = {"same": "=", "params differ": "~", "component differs": "≠", "formula differs": "≠"}


def _short(path: str) -> str:
    """A path relative to the working directory when it lies below it."""
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


def fact_notes(comp: registry.Component, values: dict[str, Any] | None = None) -> list[str]:
    """A component's facts in words; with ``values`` for one use, else for the component in general."""
    f = comp.facts
    if f.off:
        return []
    notes = []
    if f.needs:
        notes.append("needs " + ", ".join(f"{x}=" for x in f.needs))
    if f.provides:
        notes.append("provides " + ", ".join(f.provides))
    for fact, words in (("uses_ratio", "uses the ratio"), ("per_token_only", "per token only"),
                        ("sequence_level", "one ratio per sequence"),
                        ("old_from_rollout", "pi_old is the engine's logprobs: no old-logprob forward")):
        v = getattr(f, fact)
        if isinstance(v, str) and values is None:
            notes.append(f"{words} if {v}=true")
        elif comp.flag(fact, values or {}):
            notes.append(words)
        elif fact in comp.declared and fact == "uses_ratio":
            notes.append("no ratio")
    for r in f.requires:
        notes.append(f"requires {r.slot} {r.component}")
    for field, p in f.plan.items():
        val = format_value(values[p]) if values is not None else p
        if field == "replay_policy" and values is not None:  # sampling replay: its whole policy
            notes.append("carried out by the runtime: " + ReplayPolicy.of(values).describe())
        elif field == "tree_shape" and values is not None:  # sampling tree: its shape, its rows
            M, N, L, T = (int(values[k]) for k in "MNLT")
            notes.append(f"carried out by the runtime: a tree per prompt, G = M (1 + L N T) = {M * (1 + L * N * T)} "
                         "rows (rollout.n)")
        else:
            notes.append(f"carried out by the runtime: data.{field} = {val}")
    for k, p in comp.params.items():  # group_by=FIELD: the groups its formula's g(i) means
        if p.kind == "field" and values is not None and values.get(k) is not None:
            notes.append(f"groups: the rows with the same {values[k]} (across prompts)")
    if values is not None and comp.stage(values) != registry.SLOTS[comp.slot].stage:
        notes.append(f"acts in the {comp.stage(values)} stage")
    return notes


def _baseline_writes_advantage(algo: Algorithm) -> bool:
    """A baseline formula that binds ``A`` (not ``b``) writes the advantage itself."""
    return any(not v.spec.off and v.spec.formula_with(v.params).lstrip().startswith("A =")
               for v in algo.slots["baseline"])


def _without_baseline(algo: Algorithm, slot: str, text: str) -> str:
    """A normalizer's formula is written on r_i - b_i. With no baseline (an "off" one) there is
    no b_i: the advantage is shown on r_i alone, as the code computes it. With a baseline formula
    that binds A, the normalizer acts on that A: shown so (``none`` passes it on unchanged)."""
    if slot != "normalizer":
        return text
    if _baseline_writes_advantage(algo):
        if text.strip() == "A_i = r_i - b_i":
            return "A_it = A_it (the baseline's formula writes the advantage)"
        return text.replace("(r_i - b_i)", "A_it").replace("r_i - b_i", "A_it")
    if any(not v.spec.off for v in algo.slots["baseline"]):
        return text
    return text.replace("(r_i - b_i)", "r_i").replace("r_i - b_i", "r_i")


def slot_rows(algo: Algorithm) -> list[dict[str, Any]]:
    """One row per slot component: slot, component, params, formula (values substituted), source."""
    rows = []
    for slot in registry.SLOTS:
        for v in algo.slots[slot]:
            comp = v.spec
            rows.append({
                "slot": slot, "component": v.component,
                "params": {k: x for k, x in v.params.items()},
                "formula": _without_baseline(algo, slot, comp.formula_with(v.params)),
                "source": comp.source,
                "from": provenance(algo, v),
            })
    return rows


def objective_lines(algo: Algorithm) -> list[str]:
    """The whole objective as a chain of equations in data-flow order (params substituted)."""
    def f(slot: str) -> list[str]:
        return [_without_baseline(algo, slot, v.spec.formula_with(v.params))
                for v in algo.slots[slot] if not v.spec.off]

    out: list[str] = []
    for s in f("shaping"):
        out.append(f"shaping:      {s}")
    kl = algo["kl"]
    if algo.kl_in == "reward":
        out.append(f"kl in reward: r_i -= {format_value(kl.params['beta'])} * sum_t "
                   f"{kl.component}(pi_old, pi_ref)_t")
    out.append(f"baseline:     {f('baseline')[0] if f('baseline') else 'A_i = r_i'}")
    for s in f("normalizer"):
        out.append(f"normalizer:   {s}")
    for s in f("filter"):
        out.append(f"filter:       {s}")
    for s in f("correction"):
        out.append(f"correction:   {s}")
    out.append(f"ratio:        {f('ratio')[0]}")
    tr = f("trust_region")
    out.append(f"trust region: {tr[0] if tr else 'w = rho'}")
    out.append(f"objective:    {f('objective')[0]}")
    for s in f("selection"):
        out.append(f"selection:    {s}")
    extra = ""
    if algo.kl_in == "loss":
        out.append(f"kl:           {f('kl')[0]}")
        extra += f" + {format_value(kl.params['beta'])} * {kl.component}_it"
    d = algo["distill"]
    task = True
    if not d.spec.off and d.formula is None:
        p = d.params
        out.append(f"distill:      {f('distill')[0]}")
        if p.get("max_clamp") is not None:
            out.append(f"              d_it = clamp(d_it, -{format_value(p['max_clamp'])}, {format_value(p['max_clamp'])})")
        if p["mode"] == "policy_gradient":
            out.append(f"              D_it = max(-A'_it rho_it, -A'_it clip(rho_it, 1-{format_value(p['clip_low'])}, "
                       f"1+{format_value(p['clip_high'])})), at most -A'_it {format_value(p['clip_c'])} for A' < 0;  "
                       "A'_it = -sg(d_it)")
        else:
            out.append("              D_it = d_it   (minimised directly)")
        task = bool(p["task"])
        extra += f" + {format_value(p['coef'])} * D_it"
    if algo.uses_entropy:
        out.append(f"entropy:      {f('entropy')[0]}")
        ent = algo["entropy"]
        coef = ent.params.get("coef")
        # a bonus with a constant coefficient is -coef * H; a formula adds its `term`; a component
        # whose coefficient is runtime state (adaptive) adds what its entropy line above says
        extra += f" - {format_value(coef)} * H_it" if coef is not None else \
            " + term_it" if ent.formula is not None else " + entropy_it"
    out.append(f"aggregation:  {f('aggregation')[0]}")
    engine = any(INPUTS[x].source == "engine" for x in algo.needs())  # a train/inference correction
    pg = "w^IS_it l_it" if engine else "l_it"
    if f("selection"):
        pg = "keep_it " + pg
    if not task:  # distill task=false: no policy loss of the task reward
        pg, extra = "", extra[3:]
    out.append(f"minimised:    L(theta) = {algo['aggregation'].component}_it[ {pg}{extra} ]")
    if algo.uses_critic:
        out.append(f"critic:       {f('critic')[0]}")
    # a formula written over several lines continues under its first line
    return [ln if i == 0 else " " * 14 + ln for entry in out for i, ln in enumerate(entry.split("\n"))]


def to_dict(algo: Algorithm) -> dict[str, Any]:
    return {"name": algo.name, "description": algo.description, "file": algo.file,
            "extends": algo.extends, "slots": slot_rows(algo), "objective": objective_lines(algo)}


def diff(a: Algorithm, b: Algorithm) -> dict[str, Any]:
    """Slot by slot, parameter by parameter: what is the same and what differs, with provenance."""
    slots = []
    for slot in registry.SLOTS:
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


# ---------------------------------------------------------------------------------------
# Text (what `rldsl explain` prints)


def _indent(n: int, text: str, style: str = "") -> Line:
    return [(" " * n + text, style)]


def explain_lines(algo: Algorithm) -> list[Line]:
    """One algorithm: header, then per slot ``slot  component(params)  (from)`` with its
    formula and facts on their own lines below, then the whole objective."""
    head = algo.name + (f" extends {' -> '.join(algo.extends)}" if algo.extends else "")
    lines: list[Line] = [[(head, "bold")]]
    if algo.description:
        lines.append(_indent(2, algo.description))
    lines += [_indent(2, _short(algo.file), "dim"), []]
    pad = SLOT_WIDTH + 2
    for slot in registry.SLOTS:
        for i, v in enumerate(algo.slots[slot]):
            name = slot if i == 0 else ""
            lines.append([(f"{name:<{SLOT_WIDTH}}  {v}", "bold" if not v.spec.off else ""),
                          (f"  — {provenance(algo, v)}", "dim")])
            for f in _without_baseline(algo, slot, v.spec.formula_with(v.params)).splitlines():
                lines.append(_indent(pad + 2, f))
            notes = fact_notes(v.spec, v.params)
            if notes:
                lines.append(_indent(pad + 2, "; ".join(notes), "dim"))
    lines += [[], [("objective", "bold")]]
    lines += [_indent(2, line) for line in objective_lines(algo)]
    return lines


def diff_lines(a: Algorithm, b: Algorithm, show_all: bool = False) -> list[Line]:
    """Two algorithms, slot by slot: ``mark slot  A -> B``, then the changed parameters, each
    side's formula and where each side was written, one per line. Identical slots are folded
    into one closing line unless ``show_all``."""
    d = diff(a, b)
    la, lb = (a.name, b.name) if a.name != b.name else (f"{a.name} (a)", f"{b.name} (b)")
    w = max(len(la), len(lb), len("from"))
    pad = 2 + SLOT_WIDTH + 4
    lines: list[Line] = [[(f"{a.name} ({d['a_file']})  vs  {b.name} ({d['b_file']})", "bold")], []]
    folded = []
    for s in d["slots"]:
        slot, status = s["slot"], s["status"]
        if status == "same":
            if show_all:
                lines.append([(f"{MARKS[status]} {slot:<{SLOT_WIDTH}}  {s['a']}", "")])
            else:
                folded.append(slot)
            continue
        lines.append([(f"{MARKS[status]} {slot:<{SLOT_WIDTH}}  {s['a']} -> {s['b']}", "yellow")])
        for p in s.get("params", []):
            lines.append(_indent(pad, f"{p['param']}: {format_value(p['a'])} -> {format_value(p['b'])}"))
        for x in s.get("bindings", []):  # a formula against a formula: binding by binding
            lines.append(_indent(pad, f"{x['binding']}: {format_value(x['a'])} -> {format_value(x['b'])}"))
        for label, algo in ((la, a), (lb, b)):
            for v in algo.slots[slot]:
                for j, f in enumerate(v.spec.formula_with(v.params).splitlines()):
                    lines.append(_indent(pad, f"{label if j == 0 else '':<{w}}  {f}"))
        lines.append(_indent(pad, f"{'from':<{w}}  {s['a_from']} | {s['b_from']}", "dim"))
    if folded:
        lines.append([])
        lines.append([(f"= {len(folded)} identical slot(s) not shown (--all shows them): "
                       + ", ".join(folded), "dim")])
    lines.append([(f"{d['differences']} slot(s) differ", "")])
    return lines
