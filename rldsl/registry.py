"""The component registry: the single source of truth for every slot and component.

A *slot* is a role in an algorithm (``baseline``, ``trust_region``, ...). A *component*
fills a slot: a plain torch function registered under ``(slot, name)`` with typed,
range-checked parameters and a docstring that states its formula, its source and its
tensor shapes. The checker, ``rldsl explain``, the code generator and the docs all read
this registry; nothing else defines a formula.

Every component of a slot has that slot's signature (see ``SLOTS``), so the generated code
calls any of them the same way.
"""
from __future__ import annotations

import inspect
import math
import re
import types
from dataclasses import dataclass, field
from typing import Any, Callable

# ---------------------------------------------------------------------------------------
# Parameters


class _Required:
    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Param:
    """A typed component parameter.

    kind: "float" | "int" | "bool" | "choice". ``default`` is REQUIRED, None (optional,
    absent unless given) or a value. Bounds are inclusive (ge/le) or exclusive (gt/lt).
    ``runtime`` params shape the generated code (e.g. where a KL term goes) instead of
    being passed to the component function.
    """

    kind: str
    default: Any = REQUIRED
    doc: str = ""
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    runtime: bool = False

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def describe(self) -> str:
        """e.g. ``float > 0, default 0.2``."""
        parts = [self.kind if self.kind != "choice" else "|".join(self.choices)]
        for sym, v in (("> ", self.gt), (">= ", self.ge), ("< ", self.lt), ("<= ", self.le)):
            if v is not None:
                parts.append(f"{sym}{_fmt(v)}")
        if self.required:
            parts.append("required")
        elif self.default is None:
            parts.append("optional")
        else:
            parts.append(f"default {_fmt(self.default)}")
        return ", ".join(parts)

    def check(self, value: Any) -> str | None:
        """An error message if ``value`` (already typed) is out of range, else None."""
        if self.kind in ("float", "int"):
            if isinstance(value, float) and not math.isfinite(value):
                return "must be a finite number"
            for bound, ok, sym in ((self.gt, lambda v, b: v > b, ">"),
                                   (self.ge, lambda v, b: v >= b, ">="),
                                   (self.lt, lambda v, b: v < b, "<"),
                                   (self.le, lambda v, b: v <= b, "<=")):
                if bound is not None and not ok(value, bound):
                    return f"must be {sym} {_fmt(bound)}, got {_fmt(value)}"
        if self.kind == "choice" and value not in self.choices:
            return "must be one of " + ", ".join(repr(c) for c in self.choices)
        return None


def Float(default: Any = REQUIRED, doc: str = "", **kw: Any) -> Param:
    return Param("float", default, doc, **kw)


def Int(default: Any = REQUIRED, doc: str = "", **kw: Any) -> Param:
    return Param("int", default, doc, **kw)


def Bool(default: Any = REQUIRED, doc: str = "", **kw: Any) -> Param:
    return Param("bool", default, doc, **kw)


def Choice(choices: tuple[str, ...], default: Any = REQUIRED, doc: str = "", **kw: Any) -> Param:
    return Param("choice", default, doc, choices=tuple(choices), **kw)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return repr(v)
    return repr(v) if not isinstance(v, str) else v


# ---------------------------------------------------------------------------------------
# Slots


@dataclass(frozen=True)
class Slot:
    """A role in an algorithm. ``stage`` says where it acts:

    advantage — in ``estimate()`` (eager): rewards -> advantages, loss mask
    loss      — in the compiled ``loss()``
    data      — carried out by the runtime (sampling, prompt filters); declared and validated here
    declare   — a fact about the task that other slots are checked against
    """

    name: str
    stage: str
    default: str
    signature: str
    doc: str
    multi: bool = False


SLOTS: dict[str, Slot] = {s.name: s for s in [
    Slot("rewards", "declare", "scalar", "-",
         "what the verifier returns: binary (0/1) or scalar rewards"),
    Slot("shaping", "advantage", "none",
         "(rewards [B], batch) -> rewards [B]",
         "reward transforms applied before the advantage", multi=True),
    Slot("baseline", "advantage", "none",
         "(batch) -> (advantages [B, T], returns [B, T])",
         "b subtracted from the reward (or GAE with a critic); returns are value targets"),
    Slot("normalizer", "advantage", "none",
         "(adv [B, T], batch) -> adv [B, T]",
         "divides (r - b); or whitens token advantages"),
    Slot("filter", "advantage", "none",
         "(batch) -> keep [B]",
         "samples removed from the loss (masked, never dropped from metrics)", multi=True),
    Slot("sampling", "data", "once", "-",
         "how the runtime draws groups (once, or resampling until groups have mixed outcomes)"),
    Slot("ratio", "loss", "token",
         "(logp, old_logp, mask) -> log_ratio [B, T]",
         "the importance ratio: per token, or the sequence-level geometric mean (GSPO)"),
    Slot("trust_region", "loss", "none",
         "(rho, adv, logp, old_logp) -> weight [B, T]",
         "turns the ratio into the weight the objective uses (clipped, truncated or masked)"),
    Slot("objective", "loss", "ppo",
         "(weight, adv, logp) -> loss [B, T]",
         "the per-token surrogate to minimise"),
    Slot("kl", "loss", "none",
         "(logp, ref_logp, rho) -> kl [B, T]",
         "penalty against the reference policy, in the loss or in the reward"),
    Slot("entropy", "loss", "none",
         "(entropy [B, T]) -> term [B, T]",
         "entropy regularisation added to the per-token loss"),
    Slot("aggregation", "loss", "token_mean",
         "(mask [B, T], group_size) -> (weights [B, T], count [])",
         "how per-token losses become one scalar: sum(l * weights) / count, exact denominators"),
    Slot("critic", "loss", "none",
         "(values, old_values, returns) -> value_loss [B, T]",
         "a value model and its loss (needed by the gae baseline)"),
]}


# ---------------------------------------------------------------------------------------
# Components


@dataclass(frozen=True)
class Component:
    slot: str
    name: str
    fn: Callable[..., Any] | None
    params: dict[str, Param]
    doc: str
    sections: dict[str, str] = field(default_factory=dict)

    @property
    def summary(self) -> str:
        return self.doc.strip().splitlines()[0] if self.doc.strip() else ""

    @property
    def formula(self) -> str:
        return self.sections.get("formula", "")

    @property
    def source(self) -> str:
        return self.sections.get("source", "")

    @property
    def shapes(self) -> str:
        return self.sections.get("shapes", "")

    def fn_params(self, values: dict[str, Any]) -> dict[str, Any]:
        """The parameters passed to the component function (runtime ones left out)."""
        return {k: v for k, v in values.items() if not self.params[k].runtime}

    def formula_with(self, values: dict[str, Any]) -> str:
        """The formula with parameter values substituted for ``{name}`` placeholders."""
        def sub(m: re.Match[str]) -> str:
            v = values.get(m.group(1))
            return _fmt(v) if v is not None else m.group(0)
        return re.sub(r"\{(\w+)\}", sub, self.formula)


_SECTION = re.compile(r"^\s*(formula|source|shapes|edge cases):\s*(.*)$")


def parse_docstring(doc: str) -> dict[str, str]:
    """Sections ``formula:``, ``source:``, ``shapes:``, ``edge cases:`` (continuation lines indented)."""
    out: dict[str, str] = {}
    key = None
    for line in inspect.cleandoc(doc or "").splitlines():
        m = _SECTION.match(line)
        if m:
            key = m.group(1)
            out[key] = m.group(2).strip()
        elif key and line.startswith("  ") and line.strip():
            out[key] += "\n" + line.strip()
        else:
            key = None
    return out


REGISTRY: dict[str, dict[str, Component]] = {name: {} for name in SLOTS}


def register(slot: str, name: str | None = None, **params: Param) -> Callable[[Callable], Callable]:
    """Register a component function under ``(slot, name)``; the function name is the DSL name.

    Refuses to overwrite an existing name and checks the docstring has a formula and a source.
    """
    if slot not in SLOTS:
        raise KeyError(f"unknown slot {slot!r}")

    def deco(fn: Callable) -> Callable:
        key = name or fn.__name__.rstrip("_")
        if key in REGISTRY[slot]:
            raise ValueError(f"component {slot}.{key} is registered twice")
        doc = inspect.getdoc(fn) or ""
        sections = parse_docstring(doc)
        if "formula" not in sections or "source" not in sections:
            raise ValueError(f"component {slot}.{key} needs 'formula:' and 'source:' in its docstring")
        REGISTRY[slot][key] = Component(slot, key, fn, dict(params), doc, sections)
        return fn

    return deco


def declare(slot: str, name: str, doc: str, **params: Param) -> None:
    """Register a component that has no tensor function (``data``/``declare`` slots)."""
    if name in REGISTRY[slot]:
        raise ValueError(f"component {slot}.{name} is registered twice")
    doc = inspect.cleandoc(doc)
    REGISTRY[slot][name] = Component(slot, name, None, dict(params), doc, parse_docstring(doc))


def get(slot: str, name: str) -> Component:
    """The component, or a KeyError listing the valid names."""
    try:
        return REGISTRY[slot][name]
    except KeyError:
        raise KeyError(f"unknown {slot} {name!r}; valid: {', '.join(sorted(REGISTRY[slot]))}") from None


def namespaces() -> dict[str, types.SimpleNamespace]:
    """One namespace per slot holding its component functions (what generated code calls)."""
    return {slot: types.SimpleNamespace(**{n: c.fn for n, c in comps.items() if c.fn is not None})
            for slot, comps in REGISTRY.items()}


def _load() -> None:
    from . import components  # noqa: F401  (registers everything)


_load()
