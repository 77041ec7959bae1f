"""A checked formula as a registry entry: the :class:`registry.Component` and
:class:`registry.Facts` a formula slot value answers with (``SlotValue.spec``), and the
one-line text ``explain`` shows for it.

The facts come from what the formula reads (``Formula.reads``) and from the inputs table
(``rldsl/inputs.py``): a name a formula reads that is an optional input there becomes a
``needs`` of the formula, as a registry component declares it.
"""
from __future__ import annotations

from .. import registry
from ..inputs import INPUTS
from . import lang
from .check import GROUP_BY, TOPK_PARAM, Formula
from .render import binding as render_binding

# formula name -> the optional input (inputs.INPUTS) of estimate()/loss() it comes from
_NEEDS = {i.formula: i.name for i in INPUTS.values() if i.formula is not None}
# what reading G or a group reduction needs: the input whose readers compare a prompt's samples
_GROUPS = next(i.name for i in INPUTS.values() if i.whole_groups)


def facts(f: Formula) -> registry.Facts:
    """The :class:`registry.Facts` of a checked formula, from what it reads and binds.

    needs: the optional inputs behind the names it reads (those with a ``formula`` name in
    the inputs table: ref_logp, rollout_logp, ent, V) and group_size when it reads G or a
    group reduction; uses_ratio: it reads rho or w (a ratio or trust-region formula makes
    them instead); sequence_level: a ratio formula whose log_rho is one value per sequence;
    per_token_only: a trust region that reads rho together with the per-token logp or
    old_logp (a per-token divergence on the ratio; one that reads logp without rho builds
    its own ratio, as GMPO); plan: the top-K size K (``policy_topk``) of a formula reading the
    policy's top-K inputs; never off, provides nothing."""
    needs = [name for formula, name in _NEEDS.items() if formula in f.reads]
    if f.spec.stage == "advantage":  # the old / sampled log-probabilities estimate() may be given
        needs += [name for formula, name in lang.ADVANTAGE_NEEDS.items() if formula in f.reads]
    needs = list(dict.fromkeys(needs))
    if f.uses_groups:
        needs.append(_GROUPS)
    seq = f.slot == "ratio" and f.typed[f.outputs[0]].rank < 2
    # a formula reading the policy's top-K says its size K: the runtime's forwards keep that many
    topk = any(lang.INPUTS[r].rank == lang.TOPK_RANK for r in f.reads)
    return registry.Facts(needs=tuple(needs), plan={"policy_topk": TOPK_PARAM} if topk else {},
                          uses_ratio=not f.spec.makes_ratio and f.reads_any("w", "rho"),
                          sequence_level=seq,
                          per_token_only=f.slot == "trust_region" and "rho" in f.reads
                          and f.reads_any("logp", "old_logp"))


def component(f: Formula) -> registry.Component:
    """The registry entry of a checked formula: its parameters as floats with the define's
    defaults, its formula and source for explain, and the facts derived by :func:`facts`.
    No function: the generated code holds its lines."""
    hit = f.__dict__.get("_component")  # built once per checked formula, kept with it
    if hit is not None:
        return hit
    params = {k: registry.Float(d, f"a parameter of define {f.name}") for k, d in f.defaults.items()}
    if f.group_by is not None:  # its group_* functions compare the rows with equal keys
        params[GROUP_BY] = registry.Field(f"the data field define {f.name}'s group_* functions group rows by",
                                          needs=("group_keys",))
    outs = ", ".join(f"{o.name} {lang.SHAPES[o.rank]}" for o in f.spec.outputs if o.name in f.outputs)
    sections = {"formula": text(f), "source": source(f),
                "shapes": f"reads {', '.join(sorted(f.reads)) or 'no input'}; binds {outs}"}
    comp = registry.Component(f.slot, f.name, None, params, f"formula {f.name}, written in the spec",
                              sections, facts(f), frozenset(registry.SLOTS[f.slot].declares))
    object.__setattr__(f, "_component", comp)  # a cache on a frozen dataclass
    return comp


def text(f: Formula, values: bool = True) -> str:
    """A formula as one line: its outputs, then the bindings they use (parameters replaced by
    their values unless ``values`` is False)."""
    subs = f.params if values else {}
    by_name = {b.name: b for b in f.define.bindings}
    outs = [render_binding(by_name[o], subs) for o in f.outputs]
    rest = [render_binding(by_name[n], subs) for n in f.order if n not in f.outputs]
    rest = list(dict.fromkeys(r for r in rest if r not in outs))  # a search binding several names: one line
    return ";  ".join(outs) + (",  with " + ";  ".join(rest) if rest else "")


def source(f: Formula) -> str:
    return f"formula, define {f.name} ({f.file}:{f.define.name_span.line})"
