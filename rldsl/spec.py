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

from pydantic import BaseModel, ConfigDict

from . import registry
from .errors import ErrorList, Span, SpecError, SpecErrors, did_you_mean
from .formula import hooks as formula_hooks
from .parser import ArgNode, ComponentNode, SpecFile, Word, parse

ParamValue = float | int | bool | str | None

# ---------------------------------------------------------------------------------------
# The resolved model


class Origin(BaseModel):
    """Where a slot's value was written (None on a SlotValue = the slot default)."""

    model_config = ConfigDict(frozen=True)
    algorithm: str
    file: str
    line: int
    column: int


class SlotValue(BaseModel):
    """One component filling a slot, with every parameter (defaults included)."""

    model_config = ConfigDict(frozen=True)
    slot: str
    component: str
    params: dict[str, ParamValue]
    origin: Origin | None = None
    param_origins: dict[str, Origin] = {}
    formula: Any = None  # a component written in the spec: rldsl.formula.check.Formula

    @property
    def spec(self) -> registry.Component:
        return registry.get(self.slot, self.component)

    def __str__(self) -> str:
        given = {k: v for k, v in self.params.items() if v is not None}
        if not given:
            return self.component
        return f"{self.component}(" + ", ".join(f"{k}={_fmt(v)}" for k, v in given.items()) + ")"


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

    def __getitem__(self, slot: str) -> Any:
        """``algo["baseline"]`` -> SlotValue; multi-component slots (filter, shaping) -> list."""
        vals = self.slots[slot]
        return vals if registry.SLOTS[slot].multi else vals[0]

    def components(self, slot: str) -> list[str]:
        return [v.component for v in self.slots[slot]]

    @property
    def uses_critic(self) -> bool:
        return self["critic"].component != "none"

    @property
    def uses_reference(self) -> bool:
        return self["kl"].component != "none"

    @property
    def kl_in(self) -> str | None:
        kl = self["kl"]
        if kl.formula is not None:
            return formula_hooks.kl_in(kl)
        return None if kl.component == "none" else str(kl.params["where"])

    @property
    def uses_entropy(self) -> bool:
        return self["entropy"].component != "none"


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


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
    # choice
    if arg.kind == "word" and v in p.choices:
        return True, next(c for c in p.choices if c == v)  # the registry's own string
    errors.add(f"argument '{name}' must be one of " + ", ".join(repr(c) for c in p.choices) +
               f", got {v!r}", span, hint=did_you_mean(v, p.choices))
    return False, None


def _a(word: str) -> str:
    """``word`` with its indefinite article: "a baseline", "an objective"."""
    return ("an " if word[:1] in "aeiou" else "a ") + word


def _kind_words(p: registry.Param) -> str:
    return {"float": "a number", "int": "a whole number", "bool": "true or false",
            "choice": "one of " + ", ".join(repr(c) for c in p.choices)}[p.kind]


def _origin(algorithm: str, span: Span) -> Origin:
    return Origin(algorithm=algorithm, file=span.file, line=span.line, column=span.column)


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
        origins[an] = _origin(algorithm, arg.name.span)
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
                     origin=_origin(algorithm, node.name.span), param_origins=origins)


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
            errors.add(f"slot '{sname}' takes one component", extra.name.span,
                       hint="only " + " and ".join(s for s, v in registry.SLOTS.items() if v.multi) +
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
            if v.component == "none" and len(node.components) > 1:
                errors.add(f"'none' cannot be combined with other {sname} components", cnode.name.span)
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
# Cross-slot rules


Rule = Callable[[dict[str, list[SlotValue]]], Iterator[tuple[str, str, str | None]]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def _c(slots: dict[str, list[SlotValue]], s: str) -> str:
    return slots[s][0].component


@rule
def _gae_needs_critic(slots):  # type: ignore[no-untyped-def]
    if _c(slots, "baseline") == "gae" and _c(slots, "critic") == "none":
        yield "baseline", "baseline 'gae' needs a critic", "add a line: critic value(clip=0.5)"
    if _c(slots, "critic") != "none" and _c(slots, "baseline") != "gae":
        yield "critic", "a critic is only used by baseline 'gae'", \
            "use `baseline gae(...)`, or remove the critic line"


@rule
def _success_rate_needs_binary(slots):  # type: ignore[no-untyped-def]
    if _c(slots, "normalizer") == "success_rate" and _c(slots, "rewards") != "binary":
        yield "normalizer", "normalizer 'success_rate' needs binary rewards", \
            "declare `rewards binary` (the success rate is the mean of 0/1 rewards)"


@rule
def _reinforce_has_no_ratio(slots):  # type: ignore[no-untyped-def]
    if _c(slots, "objective") == "reinforce":
        if _c(slots, "trust_region") != "none":
            yield "trust_region", "objective 'reinforce' has no ratio to put a trust region on", \
                "use `objective ppo` or `objective is_weighted`, or `trust_region none`"
        if _c(slots, "ratio") != "token":
            yield "ratio", "objective 'reinforce' does not use the ratio", "remove the ratio line"


@rule
def _sequence_ratio_needs_sequence_safe_region(slots):  # type: ignore[no-untyped-def]
    if _c(slots, "ratio") == "sequence" and _c(slots, "trust_region") in ("tv", "kl_div"):
        yield "trust_region", "divergence trust regions are per token; they do not apply to a sequence ratio", \
            "use `ratio token`, or trust_region clip"


RULES.append(formula_hooks.rule)


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


def resolve(source: str, file: str = "<string>", _chain: tuple[tuple[str, str], ...] = ()) -> Algorithm:
    """Parse, check and resolve ``source`` (and its parents); raises SpecError / SpecErrors."""
    errors = ErrorList(source)
    tree = parse(source, file)  # a syntax error stops this file here
    raw = check_file(tree, errors)
    chain = _chain + ((raw.name, file),)
    parent: Algorithm | None = None
    if raw.parent is not None and _NAME.fullmatch(raw.parent):  # a bad name is reported already
        names = [n for n, _ in chain]
        if raw.parent in names:
            cycle = " -> ".join(names[names.index(raw.parent):] + [raw.parent])
            errors.add(f"'extends' makes a cycle: {cycle}", raw.parent_span)
        else:
            path = _find_parent(raw.parent, file)
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
