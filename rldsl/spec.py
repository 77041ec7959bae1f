"""Spec model: syntax nodes -> validated, fully resolved :class:`Algorithm` (pydantic).

Checks (each a :class:`SpecError` at the offending token; all errors of a file are
collected): unknown slot / component / argument (with "did you mean"), duplicated slot or
argument, wrong type, out-of-range value, missing required argument, several components in
a single-component slot, a cycle or a missing parent in ``extends``, and the cross-slot
rules in ``RULES`` (e.g. ``gae`` needs a critic).

``extends`` replaces whole slots: a child's ``trust_region clip(high=0.28)`` does not keep
the parent's ``low``; it gets the component's default. Unset slots take the slot default.
"""
from __future__ import annotations

import math
import re
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import BaseModel, ConfigDict, PrivateAttr

from . import registry
from .errors import ErrorList, Span, SpecError, SpecErrors
from .suggest import did_you_mean
from .formula import argument as formula_argument
from .formula import hooks as formula_hooks
from .inputs import INPUTS
from .parser import ArgNode, ComponentNode, SpecFile, Word, parse
from .values import Origin, ParamValue, SlotValue

# ---------------------------------------------------------------------------------------
# The resolved model


class Algorithm(BaseModel):
    """A fully resolved algorithm: every slot filled, every parameter known."""

    model_config = ConfigDict(frozen=True)
    name: str
    description: str
    file: str
    source: str
    extends: list[str] = []  # the chain of parents, nearest first
    parent_sources: dict[str, str] = {}  # parent name -> its spec text (to reproduce a run)
    slots: dict[str, list[SlotValue]]
    # active(stage), computed once: the spec is frozen, and the runtime asks ~17 times a step
    _active: dict[str | None, tuple[SlotValue, ...]] = PrivateAttr(default_factory=dict)
    # needs(stage), computed once as well: the runtime asks ~11 times a step, each a registry
    # lookup per active component
    _needs: dict[str | None, tuple[str, ...]] = PrivateAttr(default_factory=dict)
    # _any_flag(flag, stage), once per flag: old_from_rollout is asked twice a step
    _flags: dict[tuple[str, str | None], bool] = PrivateAttr(default_factory=dict)

    def __getitem__(self, slot: str) -> Any:
        """``algo["baseline"]`` -> SlotValue; multi-component slots (filter, shaping) -> list."""
        vals = self.slots[slot]
        return vals if registry.SLOTS[slot].multi else vals[0]

    def components(self, slot: str) -> list[str]:
        return [v.component for v in self.slots[slot]]

    def active(self, stage: str | None = None) -> list[SlotValue]:
        """The components that are not off (``none``), in slot order; only those acting in ``stage``
        (a declaration about the rewards acts where rewards are read: the advantage stage)."""
        got = self._active.get(stage)
        if got is None:
            got = self._active[stage] = tuple(
                v for vals in self.slots.values() for v in vals
                if not v.spec.off and (stage is None or v.stage == stage
                                       or (stage == "advantage" and v.stage == "declare")))
        return list(got)

    def needs(self, stage: str | None = None) -> list[str]:
        """The optional inputs (inputs.INPUTS) its active components read, in slot order."""
        got = self._needs.get(stage)
        if got is None:
            got = self._needs[stage] = tuple(dict.fromkeys(x for v in self.active(stage) for x in v.spec.facts.needs))
        return list(got)

    @property
    def group_by(self) -> str | None:
        """The data field its components group rows by (``group_by=FIELD``; one per spec), whose
        values the runtime turns into the ``group_keys`` input; None when none does."""
        return next(iter(_group_fields(self.active())), None)

    @property
    def uses_critic(self) -> bool:
        return not self["critic"].spec.off

    @property
    def old_from_rollout(self) -> bool:
        """pi_old is the engine's logprobs (`correction bypass`): the trainer skips the old-logprob forward."""
        return self._any_flag("old_from_rollout", None)

    def _any_flag(self, flag: str, stage: str | None) -> bool:
        """An active component (of ``stage``) sets the registry flag ``flag``; computed once."""
        got = self._flags.get((flag, stage))
        if got is None:
            got = self._flags[(flag, stage)] = any(v.spec.flag(flag, v.params) for v in self.active(stage))
        return got

    @property
    def uses_reference(self) -> bool:
        """An active component reads an input the reference model makes (inputs.INPUTS source)."""
        return any(INPUTS[x].source == "reference" for x in self.needs())

    @property
    def uses_teacher(self) -> bool:
        """An active component reads an input made from a teacher model's outputs (inputs.INPUTS)."""
        return any(INPUTS[x].teacher for x in self.needs())

    @property
    def kl_in(self) -> str | None:
        kl = self["kl"]
        return None if kl.spec.off else ("loss" if kl.stage == "loss" else "reward")

    @property
    def task_loss(self) -> bool:
        """The loss has the policy loss of the task's advantages: false only when a ``distill``
        component drops it (``task=false``: distillation alone, the generated loss's ``distill_task``)."""
        d = self["distill"]
        return d.spec.off or d.formula is not None or bool(d.params["task"])

    @property
    def uses_entropy(self) -> bool:
        return not self["entropy"].spec.off

    @property
    def uses_ratio(self) -> bool:
        """A component of the loss reads the importance ratio (else the loss skips computing it)."""
        return self._any_flag("uses_ratio", "loss")


# ---------------------------------------------------------------------------------------
# Checking one file


_NAME = re.compile(r"[a-z][a-z0-9_]*")  # a letter first: no '_x' or dunder names
_NAME_RULE = "must start with a lower case letter, then lower case letters, digits or '_'"


class _Raw(BaseModel):
    """A checked file before ``extends`` is resolved."""

    name: str
    parent: str | None
    parent_span: Any = None
    header_span: Any = None
    description: str | None
    slots: dict[str, list[SlotValue]]
    slot_spans: dict[str, Any]


def _convert(arg: ArgNode, p: registry.Param, errors: ErrorList) -> tuple[bool, ParamValue]:
    """Type a literal for parameter ``p``; report and return (False, None) on a mismatch."""
    v, span = arg.value.text, arg.value.span
    name = arg.name.text
    if p.kind == "formula":
        return _convert_formula(arg, p, errors)
    if arg.kind == "string":
        errors.add(f"argument '{name}' takes {_kind_words(p)}, not a string", span,
                   hint="strings are only allowed in the description")
        return False, None
    if p.kind in ("float", "int"):
        if arg.kind != "number":
            errors.add(f"argument '{name}' takes a number, got {v!r}", span,
                       hint=f"{name}: {p.describe()}")
            return False, None
        try:
            x = float(v)
        except ValueError:
            errors.add(f"argument '{name}': {v!r} is not a number", span)
            return False, None
        if not math.isfinite(x):
            errors.add(f"argument '{name}' must be a finite number", span, hint=f"{name}: {p.describe()}")
            return False, None
        if p.kind == "int":
            if not re.fullmatch(r"[+-]?\d+", v):
                errors.add(f"argument '{name}' takes a whole number, got {v}", span,
                           hint=f"{name}: {p.describe()}")
                return False, None
            return True, int(v)
        return True, x
    if p.kind == "bool":
        if arg.kind == "word" and v in ("true", "false"):
            return True, v == "true"
        hint = "write true or false" + (" (lower case)" if v.lower() in ("true", "false") else "")
        errors.add(f"argument '{name}' takes true or false, got {v!r}", span, hint=hint)
        return False, None
    if p.kind == "field":
        if arg.kind == "word":
            return True, v
        errors.add(f"argument '{name}' takes the name of a data field, got {v!r}", span,
                   hint=f"e.g. {name}=role (a column of the dataset)")
        return False, None
    # choice
    if arg.kind == "word" and v in p.choices:
        return True, next(c for c in p.choices if c == v)  # the registry's own string
    errors.add(f"argument '{name}' must be one of " + ", ".join(repr(c) for c in p.choices) +
               f", got {v!r}", span, hint=did_you_mean(v, p.choices))
    return False, None


def _convert_formula(arg: ArgNode, p: registry.Param, errors: ErrorList) -> tuple[bool, ParamValue]:
    """A ``formula`` parameter: one of its words, or a quoted formula of the language checked
    here as the formula of the argument (rldsl/formula/argument.py: its names, functions and
    shape), each error at its place inside the string."""
    v, span = arg.value.text, arg.value.span
    if arg.kind == "word" and v in p.choices:
        return True, v
    if arg.kind != "string":
        errors.add(f"argument '{arg.name.text}' takes {_kind_words(p)}, got {v!r}", span,
                   hint=did_you_mean(v, p.choices) or 'e.g. priority="std * sum(abs(adv))"')
        return False, None
    text = v[1:-1]
    if formula_argument.check(arg.name.text, text, span, errors) is None:
        return False, None
    return True, text


def _a(word: str) -> str:
    """``word`` with its indefinite article: "a baseline", "an objective"."""
    return ("an " if word[:1] in "aeiou" else "a ") + word


def _kind_words(p: registry.Param) -> str:
    return {"float": "a number", "int": "a whole number", "bool": "true or false",
            "choice": "one of " + ", ".join(repr(c) for c in p.choices),
            "field": "the name of a data field",
            "formula": " or ".join(repr(c) for c in p.choices) + " or a quoted group formula"}[p.kind]


def _check_component(slot: str, node: ComponentNode, algorithm: str,
                     errors: ErrorList) -> SlotValue | None:
    comps = registry.REGISTRY[slot]
    cname = node.name.text
    if cname not in comps:
        # an exact name of another slot says more than a near miss in this one
        elsewhere = [s for s, c in registry.REGISTRY.items() if cname in c and s != slot]
        takes = f"{slot} takes: " + ", ".join(sorted(comps))
        if len(elsewhere) == 1:
            hint = f"'{cname}' is {_a(elsewhere[0])} component; {takes}"
        else:
            hint = did_you_mean(cname, comps) or takes
        errors.add(f"unknown {slot} '{cname}'", node.name.span, hint=hint)
        return None
    comp = comps[cname]
    values: dict[str, ParamValue] = {}
    origins: dict[str, Origin] = {}
    seen: dict[str, Word] = {}
    ok = True
    for arg in node.args:
        an = arg.name.text
        if an not in comp.params:
            if comp.params:
                hint = did_you_mean(an, comp.params) or \
                    f"{slot} {cname} takes: " + ", ".join(comp.params)
            else:
                hint = f"{slot} {cname} takes no arguments"
            errors.add(f"unknown argument '{an}' for {slot} {cname}", arg.name.span, hint=hint)
            ok = False
            continue
        if an in seen:
            errors.add(f"argument '{an}' is given twice", arg.name.span,
                       hint=f"first given at line {seen[an].span.line}, column {seen[an].span.column}")
            ok = False
            continue
        seen[an] = arg.name
        p = comp.params[an]
        good, val = _convert(arg, p, errors)
        if not good:
            ok = False
            continue
        msg = p.check(val)
        if msg:
            errors.add(f"argument '{an}' of {slot} {cname} {msg}", arg.value.span,
                       hint=f"{an}: {p.describe()}" + (f" — {p.doc}" if p.doc else ""))
            ok = False
            continue
        values[an] = val
        origins[an] = Origin.at(algorithm, arg.name.span)
    for pname, p in comp.params.items():
        if pname not in values and pname not in seen:
            if p.required:
                errors.add(f"{slot} {cname} needs argument '{pname}'", node.name.span,
                           hint=f"write {cname}({pname}=...)  — {pname}: {p.describe()}" +
                           (f", {p.doc}" if p.doc else ""))
                ok = False
            else:
                values[pname] = p.default
    if not ok:
        return None
    ordered = {k: values[k] for k in comp.params}
    return SlotValue(slot=slot, component=cname, params=ordered,
                     origin=Origin.at(algorithm, node.name.span), param_origins=origins)


def check_file(spec: SpecFile, errors: ErrorList) -> _Raw:
    """Check one parsed file against the registry; errors go to ``errors``."""
    name = spec.name.text
    for what, word in (("algorithm name", spec.name), ("parent name", spec.extends)):
        if word is not None and not _NAME.fullmatch(word.text):
            low = word.text.lower()
            errors.add(f"{what} '{word.text}' {_NAME_RULE}", word.span,
                       hint=f"e.g. {low!r}" if _NAME.fullmatch(low) else None)
    description = None
    for i, d in enumerate(spec.descriptions):
        if i == 0:
            description = d.text[1:-1]
        else:
            errors.add("a second description", d.span,
                       hint=f"the description is given at line {spec.descriptions[0].span.line}")
    slots: dict[str, list[SlotValue]] = {}
    spans: dict[str, Span] = {}
    defines = formula_hooks.defines(spec, errors)  # components written in the spec
    reported: set[tuple[str, Span]] = set()
    used: set[str] = set()
    for node in spec.slots:
        sname = node.name.text
        if sname not in registry.SLOTS:
            hint = did_you_mean(sname, registry.SLOTS)
            if hint is None:
                owners = [s for s, c in registry.REGISTRY.items() if sname in c]
                hint = (f"'{sname}' is {_a(owners[0])} component: write `{owners[0]} {sname}`"
                        if len(owners) == 1 else "slots: " + ", ".join(registry.SLOTS))
            errors.add(f"unknown slot '{sname}'", node.name.span, hint=hint)
            continue
        if sname in spans:
            errors.add(f"slot '{sname}' is set twice", node.name.span,
                       hint=f"first set at line {spans[sname].line}")
            continue
        spans[sname] = node.name.span
        slot = registry.SLOTS[sname]
        if len(node.components) > 1 and not slot.multi:
            extra = node.components[1]
            multi = [s for s, v in registry.SLOTS.items() if v.multi]
            errors.add(f"slot '{sname}' takes one component", extra.name.span,
                       hint="only " + ", ".join(multi[:-1]) + " and " + multi[-1] +
                       " take a comma-separated list")
            continue
        vals: list[SlotValue] = []
        names_seen: set[str] = set()
        for cnode in node.components:
            cname = cnode.name.text
            if cname in defines:
                used.add(cname)
                v = formula_hooks.slot_value(sname, cnode, defines[cname], name, spec.file, errors, reported)
            elif cname not in registry.REGISTRY[sname] and formula_hooks.misspelt(cname, defines):
                used.update(formula_hooks.misspelt(cname, defines))  # reported here, not as unused
                errors.add(f"unknown {sname} '{cname}'", cnode.name.span, hint=did_you_mean(cname, defines))
                v = None
            else:
                v = _check_component(sname, cnode, name, errors)
            if v is None:
                continue
            if v.component in names_seen:
                errors.add(f"{sname} '{v.component}' is listed twice", cnode.name.span)
                continue
            if v.spec.off and len(node.components) > 1:
                errors.add(f"'{v.component}' cannot be combined with other {sname} components",
                           cnode.name.span)
                continue
            names_seen.add(v.component)
            vals.append(v)
        if len(vals) == len(node.components):
            slots[sname] = vals
    formula_hooks.unused(defines, used, errors)
    return _Raw(name=name, parent=spec.extends.text if spec.extends else None,
                parent_span=spec.extends.span if spec.extends else None,
                header_span=spec.name.span, description=description, slots=slots, slot_spans=spans)


# ---------------------------------------------------------------------------------------
# Cross-slot rules: conditions on component facts (registry.Facts), never on names


Rule = Callable[[dict[str, list[SlotValue]]], Iterator[tuple[str, str, str | None]]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def _active(slots: dict[str, list[SlotValue]]) -> list[SlotValue]:
    return [v for vals in slots.values() for v in vals if not v.spec.off]


def _all_components() -> list[registry.Component]:
    return [c for comps in registry.REGISTRY.values() for c in comps.values()]


def _use(c: registry.Component) -> str:
    return f"`{c.slot} {c.name}{'(...)' if c.params else ''}`"


@rule
def _provided_inputs(slots):  # type: ignore[no-untyped-def]
    """An input the algorithm itself makes (a critic's values) must have a maker and a reader."""
    active = _active(slots)
    made = {x: v for v in active for x in v.spec.facts.provides}
    makers = {x: c for c in reversed(_all_components()) for x in c.facts.provides}  # first registered
    for v in active:
        for x in v.spec.facts.needs:
            if x in makers and x not in made:
                m = makers[x]
                yield v.slot, f"{v.slot} '{v.component}' needs {_a(m.slot)}", \
                    f"add a line: {m.slot} {m.example()}"
    for x, v in made.items():
        if not any(x in u.spec.facts.needs for u in active if u is not v):
            readers = [c for c in _all_components() if x in c.facts.needs and x not in c.facts.provides]
            yield v.slot, f"{_a(v.slot)} is only used by " + \
                " or ".join(f"{c.slot} '{c.name}'" for c in readers), \
                "use " + " or ".join(_use(c) for c in readers) + f", or remove the {v.slot} line"


def _group_fields(active: list[SlotValue]) -> dict[str, SlotValue]:
    """Each data field named by a ``field`` parameter (``group_by=role``), with its first user."""
    out: dict[str, SlotValue] = {}
    for v in active:
        for k, p in v.spec.params.items():
            if p.kind == "field" and v.params.get(k) is not None:
                out.setdefault(str(v.params[k]), v)
    return out


@rule
def _one_group_field(slots):  # type: ignore[no-untyped-def]
    """Every ``group_by`` of a spec names the same data field: one ``group_keys`` input."""
    fields = _group_fields(_active(slots))
    if len(fields) > 1:
        (f0, v0), *rest = fields.items()
        for f, v in rest:
            yield v.slot, f"{v.slot} '{v.component}' groups by '{f}' but {v0.slot} '{v0.component}' " \
                f"by '{f0}': a spec groups by one data field", f"use group_by={f0} in both"


@rule
def _one_plan_value(slots):  # type: ignore[no-untyped-def]
    """Components that set the same field of the runtime's plan (``plan`` facts, e.g. the top-K
    size K of two formulas reading the policy's top-K) set it to one value: the forwards make one."""
    first: dict[str, tuple[SlotValue, object]] = {}
    for v in _active(slots):
        for f, p in v.spec.facts.plan.items():
            value = v.params.get(p)
            if f not in first:
                first[f] = (v, value)
            elif first[f][1] != value:
                v0, x0 = first[f]
                yield v.slot, f"{v.slot} '{v.component}' sets {p} = {value} but {v0.slot} '{v0.component}' " \
                    f"{x0}: the runtime makes one ({registry.PLAN[f]})", f"give both {p} = {x0}"


@rule
def _requirements(slots):  # type: ignore[no-untyped-def]
    """Facts ``requires=Requires(slot, component)``: e.g. success_rate needs binary rewards."""
    for v in _active(slots):
        for r in v.spec.facts.requires:
            if r.component not in [u.component for u in slots[r.slot]]:
                yield v.slot, f"{v.slot} '{v.component}' needs {r.component} {r.slot}", \
                    f"declare `{r.slot} {r.component}`" + (f" ({r.why})" if r.why else "")


@rule
def _ratio_needs_a_reader(slots):  # type: ignore[no-untyped-def]
    """An objective that does not use the ratio leaves the ratio and trust region slots nothing to do."""
    obj = slots["objective"][0]
    if obj.spec.flag("uses_ratio", obj.params):
        return
    tr, ratio = slots["trust_region"][0], slots["ratio"][0]
    if not tr.spec.off:
        users = [c for c in registry.REGISTRY["objective"].values() if c.flag("uses_ratio", {})]
        off = [c.name for c in registry.REGISTRY["trust_region"].values() if c.off]
        yield "trust_region", f"objective '{obj.component}' has no ratio to put a trust region on", \
            "use " + " or ".join(f"`objective {c.name}`" for c in users) + f", or `trust_region {off[0]}`"
    if ratio.component != registry.SLOTS["ratio"].default:
        yield "ratio", f"objective '{obj.component}' does not use the ratio", "remove the ratio line"


@rule
def _per_token_only_needs_a_token_ratio(slots):  # type: ignore[no-untyped-def]
    """Facts ``per_token_only`` (tv, kl_div) against a ``sequence_level`` ratio."""
    ratio = slots["ratio"][0]
    if not ratio.spec.flag("sequence_level", ratio.params):
        return
    token = [c.name for c in registry.REGISTRY["ratio"].values() if not c.flag("sequence_level", {})]
    for v in _active(slots):
        if v.spec.flag("per_token_only", v.params):
            alt = [c.name for c in registry.REGISTRY[v.slot].values()
                   if not c.off and not c.flag("per_token_only", {})]
            yield v.slot, f"{v.slot} '{v.component}' is per token; it does not apply to a sequence ratio", \
                f"use `ratio {token[0]}`" + (f", or {v.slot} {alt[0]}" if alt else "")



# ---------------------------------------------------------------------------------------
# Loading and resolving


def library_dir() -> Path:
    """The folder of the shipped algorithm library."""
    return Path(str(resources.files("rldsl._algorithms")))


def library() -> dict[str, Path]:
    """Library algorithm name -> path."""
    return {p.stem: p for p in sorted(library_dir().glob("*.rl"))}


def _find_parent(name: str, child_file: str) -> Path | None:
    here = Path(child_file).parent if child_file and not child_file.startswith("<") else None
    if here is not None and (here / f"{name}.rl").is_file():
        return here / f"{name}.rl"
    return library().get(name)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark is not part of the spec
    except UnicodeDecodeError as e:
        raise SpecError(f"not a UTF-8 text file ({e.reason})", Span(str(path))) from None


#: How many ancestors a spec may have: each is resolved by a nested call (its errors are the
#: child's), so a longer chain is refused at the ``extends`` that passes the limit.
MAX_PARENTS = 64


def _same_file_key(file: str) -> str:
    """The key under which two names of one file compare equal (text given inline has none)."""
    if file.startswith("<"):
        return file
    try:
        return str(Path(file).resolve())
    except (OSError, RuntimeError):  # pragma: no cover - an unreadable path: compare as written
        return file


def _step(name: str, file: str) -> str:
    """One link of a cycle as the user reads it: the algorithm, and its file when that is named otherwise."""
    return name if file.startswith("<") or Path(file).stem == name else f"{name} ({Path(file).name})"


def resolve(source: str, file: str = "<string>", _chain: tuple[tuple[str, str], ...] = ()) -> Algorithm:
    """Parse, check and resolve ``source`` (and its parents); raises SpecError / SpecErrors."""
    errors = ErrorList(source)
    tree = parse(source, file)  # a syntax error stops this file here
    raw = check_file(tree, errors)
    chain = _chain + ((raw.name, file),)
    parent: Algorithm | None = None
    if raw.parent is not None and _NAME.fullmatch(raw.parent):  # a bad name is reported already
        names = [n for n, _ in chain]
        path = _find_parent(raw.parent, file)
        files = [_same_file_key(f) for _, f in chain]
        key = _same_file_key(str(path)) if path is not None else None
        if raw.parent in names or (key is not None and key in files):
            # a cycle by algorithm name, or through files whose names differ from their algorithms'
            if raw.parent in names:
                cycle = " -> ".join(names[names.index(raw.parent):] + [raw.parent])
            else:  # name each file too: the names alone do not show where the cycle closes
                start = files.index(key)
                cycle = " -> ".join([_step(n, f) for n, f in chain[start:]] + [_step(*chain[start])])
            errors.add(f"'extends' makes a cycle: {cycle}", raw.parent_span)
        elif len(chain) > MAX_PARENTS:
            errors.add(f"'extends' chain longer than {MAX_PARENTS} parents", raw.parent_span,
                       hint="a spec extends a library algorithm or a spec that does; flatten the chain")
        else:
            if path is None:
                hint = did_you_mean(raw.parent, library()) or \
                    "parents are looked up next to this file, then in the library (rldsl list)"
                errors.add(f"unknown parent algorithm '{raw.parent}'", raw.parent_span, hint=hint)
            else:
                try:
                    parent = resolve(_read(path), str(path), chain)
                except SpecError as e:
                    errs = e.errors if isinstance(e, SpecErrors) else [e]
                    errors.add(f"parent algorithm '{raw.parent}' has errors ({len(errs)}, shown below)",
                               raw.parent_span)
                    errors.extend(errs)
    errors.raise_if_any()
    slots: dict[str, list[SlotValue]] = {}
    for sname, slot in registry.SLOTS.items():
        if sname in raw.slots:
            slots[sname] = raw.slots[sname]
        elif parent is not None:
            slots[sname] = parent.slots[sname]
        else:
            comp = registry.get(sname, slot.default)
            slots[sname] = [SlotValue(slot=sname, component=slot.default,
                                      params={k: p.default for k, p in comp.params.items()})]
    for r in RULES:
        for sname, msg, hint in r(slots):
            origin = slots[sname][0].origin
            if origin is not None and origin.file == file:
                span = Span(origin.file, origin.line, origin.column, len(slots[sname][0].component))
            else:
                span = raw.header_span
                msg += f" (slot {sname} is {'inherited' if origin else 'the default'})"
            errors.add(msg, span, hint=hint)
    errors.raise_if_any()
    description = raw.description if raw.description is not None else (parent.description if parent else "")
    return Algorithm(name=raw.name, description=description, file=file, source=source,
                     extends=([parent.name] + parent.extends) if parent else [],
                     parent_sources={parent.name: parent.source, **parent.parent_sources} if parent else {},
                     slots=slots)


def loads(text: str, filename: str = "<string>") -> Algorithm:
    """Resolve a spec from text."""
    return resolve(text, filename)


def load(path_or_name: str | Path) -> Algorithm:
    """Resolve a spec from a path, or from a library name such as ``"dapo"``."""
    p = Path(path_or_name)
    if not p.is_file():
        name = str(path_or_name)
        lib = library()
        if name in lib:
            p = lib[name]
        elif name.endswith(".rl") and Path(name).name[:-3] in lib and not p.exists():
            raise SpecError(f"no such file: {name}", Span(name),
                            hint=f"the library has '{Path(name).name[:-3]}': rldsl run {Path(name).name[:-3]}")
        else:
            hint = did_you_mean(p.stem, lib) or "library algorithms: " + ", ".join(lib)
            raise SpecError(f"no such spec file or library algorithm: {name}", Span(name), hint=hint)
    return resolve(_read(p), str(p))


from . import components  # noqa: E402,F401 - every component registered before a spec is read (``import rldsl`` no longer does it)
