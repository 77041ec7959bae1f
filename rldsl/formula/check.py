"""The formula checker: a ``define`` used in a slot -> a typed, shape-checked :class:`Formula`.

Everything is decided here, before any code exists: names (slot inputs, parameters, other
bindings; did-you-mean on a typo), arity, kinds (number vs true/false), shapes ([], [B],
[B, T], [B, T, K], broadcast upwards only; a [B] value never meets a [B, T, K] one), the
top-K size K of a formula reading the policy's top-K, the shape each output of the slot needs, division by a
constant zero, constants without a finite value, cycles, unused bindings, and reductions
that would read padding (every reduction is masked; unmasked ones do not exist). Each
problem is a SpecError at the offending sub-expression.

Constants are folded with Python floats (the same arithmetic the registry components do
with their parameters), so parameters reach the code as checked literals.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

from ..errors import ErrorList, Span
from ..suggest import did_you_mean
from . import lang
from .nodes import ARITHMETIC, Binary, Binding, Call, Define, Expr, List, Name, Neg, Num, Tuple, literal_number, walk
from .render import number, render

_BINDING_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Typed:
    """A checked expression: kind ("num" | "bool"), rank (0 [], 1 [B], 2 [B, T], 3 [B, T, K]), the constant
    value when it has one, and its checked parts.

    op: "const" (a number or a parameter, folded), "input", "ref" (another binding), "call",
    "neg", "operator", "search" (bisect / first_of: args are its bounds or its candidates, one
    after the other, then its condition; ``index``: which of the line's names this binding is),
    "bound" (the searched variable, inside the search's condition); ``name``: the input,
    parameter, binding, function or operator.
    """

    node: Expr
    kind: str
    rank: int
    const: float | bool | None
    op: str
    name: str = ""
    args: tuple["Typed", ...] = ()
    index: int = 0


@dataclass(frozen=True)
class Formula:
    """A define, checked for one slot, with its parameters resolved: what the emitter compiles."""

    name: str
    slot: str
    define: Define
    file: str
    params: dict[str, float]           # the values in use (defaults, or the slot line's)
    defaults: dict[str, float]
    order: tuple[str, ...]             # the computed bindings, dependencies first
    typed: dict[str, Typed] = field(repr=False)
    outputs: tuple[str, ...] = ()      # the slot outputs it binds, in the slot's order
    reads: frozenset[str] = frozenset()  # slot inputs it reads
    group_by: str | None = None        # the slot line's group_by=FIELD: its group_* functions group by it

    @property
    def spec(self) -> lang.FormulaSlot:
        spec = lang.formula_slot(self.slot)
        assert spec is not None, self.slot
        return spec

    def reads_any(self, *names: str) -> bool:
        return any(n in self.reads for n in names)

    @property
    def uses_groups(self) -> bool:
        """Reads G or a group reduction: needs the true group size."""
        return "G" in self.reads or any(
            t.op == "call" and lang.FUNCTIONS[t.name].scope == "group"
            for name in self.order for t in _walk_typed(self.typed[name]))

    @property
    def uses_group_functions(self) -> bool:
        """Calls a ``group_*`` reduction or order operation (what ``group_by=FIELD`` regroups)."""
        return any(t.op == "call" and lang.FUNCTIONS[t.name].scope == "group"
                   for name in self.order for t in _walk_typed(self.typed[name]))

    @property
    def batch_wide(self) -> bool:
        """Reads a ``batch_*`` function (a reduction or an order operation): its value depends on
        every row given to the stage's function. In ``loss()`` that is the rows of one call, so
        such a loss formula is batch-wide only when ``loss()`` receives the whole batch."""
        return any(t.op == "call" and lang.FUNCTIONS[t.name].scope == "batch"
                   for name in self.order for t in _walk_typed(self.typed[name]))


def _walk_typed(t: Typed):  # noqa: ANN202
    yield t
    for a in t.args:
        yield from _walk_typed(a)


def _shape(rank: int) -> str:
    return lang.SHAPES[rank]


def _kind_words(kind: str) -> str:
    return "a number" if kind == "num" else "true/false (a comparison)"


class _Reporter:
    """Adds errors once: a define used in two slots reports a problem of its body once."""

    def __init__(self, errors: ErrorList, reported: set[tuple[str, Span]]):
        self.errors = errors
        self.reported = reported
        self.count = 0

    def __call__(self, message: str, span: Span, hint: str | None = None) -> None:
        self.count += 1
        key = (message, span)
        if key not in self.reported:
            self.reported.add(key)
            self.errors.add(message, span, hint=hint)


# ---------------------------------------------------------------------------------------
# Parameters given on the slot line


# the argument of a slot line that regroups a formula's group_* functions by a data field
GROUP_BY = "group_by"


def _override(arg, define: Define, params: dict[str, float], add: _Reporter) -> float | None:  # noqa: ANN001
    """The number a slot line gives parameter ``arg.name`` (a parser ``ArgNode``), or None."""
    name, kind, text, span = arg.name.text, arg.kind, arg.value.text, arg.value.span
    if kind == "string":
        add(f"argument '{name}' takes a number, not a string", span,
            hint="strings are only allowed in the description")
        return None
    if kind != "number":
        add(f"argument '{name}' takes a number, got {text!r}", span,
            hint=f"{name}: a parameter of {define.name}, default {_num(params[name])}")
        return None
    value = float(text)
    if not math.isfinite(value):
        add(f"argument '{name}' must be a finite number", span)
        return None
    return value


def _num(x: float | bool) -> str:
    """A constant as the spec writes it (messages)."""
    if isinstance(x, bool):
        return "true" if x else "false"
    return number(x)


# ---------------------------------------------------------------------------------------
# The checker


class _Checker:
    def __init__(self, slot: str, define: Define, add: _Reporter, params: dict[str, float]):
        self.slot = slot
        spec = lang.formula_slot(slot)
        assert spec is not None, slot
        self.spec = spec
        self.define = define
        self.add = add
        self.params = params
        self.inputs = set(self.spec.inputs)
        self.outputs = {o.name: o for o in self.spec.outputs}
        self.bindings: dict[str, Binding] = {}
        self.typed: dict[str, Typed] = {}
        self.current: Binding | None = None  # the binding being checked
        self.bound: frozenset[str] = frozenset()  # the searched variables, inside a search's condition

    # -- names --------------------------------------------------------------------------

    def resolve(self, name: str) -> str:
        """What a name means here: "param", "input", "binding" or "unknown".

        A slot input always means the input, also when an output has its name (a
        normalizer's ``A = A / s`` reads the incoming A); inside a search's condition the
        binding's own names are the searched variable ("bound")."""
        if name in self.bound:
            return "bound"
        if name in self.params:
            return "param"
        if name in self.inputs:
            return "input"
        if name in self.bindings:
            return "binding"
        return "unknown"

    def unknown_name(self, node: Name) -> None:
        name = node.name
        if name in lang.FUNCTIONS:
            self.add(f"'{name}' is a function: call it, e.g. {name}(x)", node.span)
            return
        known = sorted(self.inputs | set(self.bindings) | set(self.params))
        if name in lang.INPUTS:  # an input of other slots
            others = ([s for s, fs in lang.SLOTS.items() if name in fs.inputs]  # else an argument's: priority
                      or [s for s, fs in lang.ARGUMENTS.items() if name in fs.inputs])
            # the sequence reward has a name of its own in the loss slots
            alias = " (the sequence's reward is `reward` here)" if name == "r" and "reward" in self.spec.inputs else ""
            self.add(f"'{name}' is not an input of {self.slot}{alias}", node.span,
                     hint=f"{name} is read by " + ", ".join(others) + f" formulas; {self.slot} formulas read: " +
                     ", ".join(self.spec.inputs))
            return
        hint = did_you_mean(name, known)
        if hint is None:
            hint = f"{self.slot} formulas read: " + ", ".join(self.spec.inputs) + \
                ("; parameters and bindings: " + ", ".join(sorted(set(self.bindings) | set(self.params)))
                 if self.bindings or self.params else "")
        self.add(f"unknown name '{name}'", node.span, hint=hint)

    # -- expressions --------------------------------------------------------------------

    def expr(self, e: Expr) -> Typed | None:
        if isinstance(e, Num):
            value = float(e.text)
            if not math.isfinite(value):
                self.add(f"the number {e.text} is not finite", e.span)
                return None
            return Typed(e, "num", 0, value, "const")
        if isinstance(e, Name):
            what = self.resolve(e.name)
            if what == "bound":
                return Typed(e, "num", 0, None, "bound", e.name)
            if what == "param":
                return Typed(e, "num", 0, self.params[e.name], "const", e.name)
            if what == "input":
                return Typed(e, "num", lang.INPUTS[e.name].rank, None, "input", e.name)
            if what == "binding":
                t = self.typed.get(e.name)
                if t is None:  # its own definition failed: already reported
                    return None
                return Typed(e, t.kind, t.rank, t.const, "ref", e.name)
            self.unknown_name(e)
            return None
        if isinstance(e, Neg):
            x = self.expr(e.operand)
            if x is None or not self.number(x, "'-'"):
                return None
            return self.folded(Typed(e, "num", x.rank, None if x.const is None else -x.const, "neg", "-", (x,)))
        if isinstance(e, Binary):
            return self.binary(e)
        if isinstance(e, List):
            self.add("a list [...] is only the candidates of a search", e.span,
                     hint="x = first_of([c1, c2, ...], cond): the first candidate at which cond holds")
            return None
        if isinstance(e, Tuple):
            self.add("a tuple (a, b) is only a candidate of a search that binds several names", e.span,
                     hint="a, b = first_of([(a1, b1), (a2, b2)], cond)")
            return None
        assert isinstance(e, Call)
        return self.call(e)

    def number(self, t: Typed, where: str) -> bool:
        if t.kind != "num":
            self.add(f"{where} takes a number, got a comparison (true/false)", t.node.span,
                     hint="turn a condition into numbers with where(condition, 1, 0)")
            return False
        return True

    def folded(self, t: Typed) -> Typed | None:
        if isinstance(t.const, float) and not math.isfinite(t.const):
            self.add("this constant has no finite value", t.node.span,
                     hint=f"it evaluates to {t.const!r}")
            return None
        return t

    def binary(self, e: Binary) -> Typed | None:
        a, b = self.expr(e.left), self.expr(e.right)
        if e.op == "/" and b is not None and b.const is not None and b.const == 0:
            self.zero_division(b)  # also when the numerator has an error of its own
            return None
        if a is None or b is None:
            return None
        word = f"'{e.op}'"
        if not (self.number(a, word) and self.number(b, word)):
            return None
        if not self.meet(e, (a, b)):
            return None
        rank = max(a.rank, b.rank)
        if e.op not in ARITHMETIC:
            const = None if a.const is None or b.const is None else _compare(e.op, a.const, b.const)
            return Typed(e, "bool", rank, const, "operator", e.op, (a, b))
        if e.op == "^" and a.const == 0 and b.const is not None and b.const < 0:
            self.zero_division(a)
            return None
        const = None
        if a.const is not None and b.const is not None:
            const = _arith(e.op, float(a.const), float(b.const))
        return self.folded(Typed(e, "num", rank, const, "operator", e.op, (a, b)))

    def meet(self, e: Expr, parts: tuple[Typed, ...]) -> bool:
        """Values of different shapes meet by broadcasting one axis up ([] anywhere, [B] -> [B, T],
        [B, T] -> [B, T, K]); a [B] value meeting a [B, T, K] one is an error: a per-sequence value
        against per-candidate values is where a missing reduction hides (docs/formulas.md)."""
        ranks = {p.rank for p in parts if p.const is None}
        if 1 in ranks and lang.TOPK_RANK in ranks:
            seq = next(p for p in parts if p.const is None and p.rank == 1)
            self.add(f"{render(seq.node)} is [B] and meets a [B, T, K] value in {render(e)}", seq.node.span,
                     hint=lang.SKIPS_AXIS)
            return False
        return True

    def zero_division(self, t: Typed) -> None:
        params = sorted({n.name for n in walk(t.node) if isinstance(n, Name) and n.name in self.params})
        hint = None
        if params:
            hint = "with " + ", ".join(f"{p} = {_num(self.params[p])}" for p in params)
        text = render(t.node)
        self.add("division by zero" + ("" if literal_number(t.node) else f": {text} is 0"),
                 t.node.span, hint=hint)

    def call(self, e: Call) -> Typed | None:
        f = lang.FUNCTIONS.get(e.func)
        n = len(e.args)
        scope = self.spec.plain_scope
        if scope and e.func in lang.REDUCTIONS and n == 1 and (f is None or f.kind == "minmax"):
            f = lang.FUNCTIONS[f"{scope}_{e.func}"]  # a plain sum(x) reduces the slot's rows
        if f is None or (f.kind == "minmax" and n == 1):
            self.unknown_function(e)
            return None
        if scope and f.scope not in lang.ARGUMENT_SCOPES:
            plain = ", ".join(r for r in lang.REDUCTIONS if r != "quantile")
            self.add(f"{f.name} is not available in a {self.slot} formula: it reads one group's rows, "
                     "without tokens or other groups", e.func_span,
                     hint=f"reduce the group's rows with {plain} (x)")
            return None
        if f.kind == "search":
            return self.search(e, f)
        if n not in f.arity:
            want = f.arity[0]
            self.add(f"{f.name} takes {want} argument{'s' if want != 1 else ''}, got {n}", e.span,
                     hint=f.doc)
            return None
        args = [self.expr(a) for a in e.args]
        if any(a is None for a in args):
            return None
        targs = tuple(a for a in args if a is not None)
        if f.kind == "where":
            return self.where(e, targs)
        for i, a in enumerate(targs):
            if not self.number(a, f"{f.name}" + ("'s first argument" if len(targs) > 1 and i == 0 else
                                                  f"'s argument {i + 1}" if len(targs) > 1 else "")):
                return None
        if f.kind == "reduce":
            return self.reduce(e, f, targs)
        if f.kind == "order":
            return self.order(e, f, targs)
        if f.kind == "kreduce":
            return self.kreduce(e, f, targs[0])
        if not self.meet(e, targs):
            return None
        rank = max(a.rank for a in targs)
        consts = [a.const for a in targs]
        const = None
        if all(c is not None for c in consts):
            const = _fold(f, [float(c) for c in consts])  # type: ignore[arg-type]
            if const is None:
                self.add(f"{render(e)} has no finite value", e.span)
                return None
        if f.kind == "clamp" and targs[1].const is not None and targs[2].const is not None \
                and targs[1].const > targs[2].const:
            self.add(f"clamp's low bound {_num(targs[1].const)} is above its high bound "
                     f"{_num(targs[2].const)}", e.span, hint="clamp(x, low, high)")
            return None
        return self.folded(Typed(e, "num", rank, const, "call", f.name, targs))

    def where(self, e: Call, args: tuple[Typed, ...]) -> Typed | None:
        c, a, b = args
        if c.kind != "bool":
            self.add("where's first argument must be a condition (a comparison)", c.node.span,
                     hint="e.g. where(A > 0, a, b)")
            return None
        if a.kind != b.kind:
            self.add(f"where's branches differ: {_kind_words(a.kind)} and {_kind_words(b.kind)}", e.span)
            return None
        if c.const is not None:  # a constant condition picks its branch
            return a if c.const else b
        if not self.meet(e, args):
            return None
        rank = max(c.rank, a.rank, b.rank)
        return Typed(e, a.kind, rank, None, "call", "where", args)

    def topk_first(self, f: lang.Function, x: Typed, what: str) -> bool:
        """A seq/group/batch function of a [B, T, K] value is an error: reduce the K axis first."""
        if x.rank != lang.TOPK_RANK:
            return True
        self.add(f"{f.name} {what} [B] or [B, T] values, got [B, T, K]", x.node.span,
                 hint=f"reduce the top-K axis first, e.g. {f.name}(k_sum(...)); k_sum, k_mean, k_max, k_min "
                      "reduce it")
        return False

    def kreduce(self, e: Call, f: lang.Function, x: Typed) -> Typed | None:
        """``k_sum(x)`` ...: [B, T, K] -> [B, T]; anything else has no K axis to reduce."""
        if x.rank != lang.TOPK_RANK:
            self.add(f"{f.name} reduces the top-K axis of a [B, T, K] value, got {_shape(x.rank)}", x.node.span,
                     hint="the policy's top-K inputs (topk_logp, old_topk_logp) have it; "
                          "seq_*, group_* and batch_* reduce the other axes")
            return None
        return Typed(e, "num", 2, None, "call", f.name, (x,))

    def reduce(self, e: Call, f: lang.Function, args: tuple[Typed, ...]) -> Typed | None:
        x = args[0]
        if not self.topk_first(f, x, "reduces"):
            return None
        if f.scope == "group" and x.rank > 1:
            self.add(f"{f.name} takes one value per sequence [B], got {_shape(x.rank)}", x.node.span,
                     hint=f"reduce each sequence's tokens first, e.g. {f.name}(seq_mean(...))")
            return None
        if len(args) == 2:
            q = args[1]
            if q.rank > 0:
                self.add(f"{f.name}'s level q must be one number [], got {_shape(q.rank)}", q.node.span,
                         hint=f"e.g. {f.name}(x, 0.9) or {f.name}(x, 1 - 1 / G); reduce it first, "
                              "e.g. batch_mean(...)")
                return None
            if q.const is not None and not (0.0 <= float(q.const) <= 1.0):
                self.add(f"{f.name}'s level q must be between 0 and 1, got {_num(q.const)}", q.node.span,
                         hint=f"e.g. {f.name}(x, 0.9); a level that is an expression is clamped to [0, 1]")
                return None
        rank = 0 if f.scope == "batch" else 1
        return Typed(e, "num", rank, None, "call", f.name, args)

    def order(self, e: Call, f: lang.Function, args: tuple[Typed, ...]) -> Typed | None:
        """An order operation keeps its argument's shape in its scope: seq -> [B, T], group ->
        [B] (a [B, T] argument is an error), batch -> [B] or [B, T]; topk_mask's k is one number."""
        x = args[0]
        if not self.topk_first(f, x, "orders"):
            return None
        if f.scope == "group" and x.rank > 1:
            self.add(f"{f.name} orders one value per sequence [B], got {_shape(x.rank)}", x.node.span,
                     hint=f"reduce each sequence's tokens first, e.g. {f.name}(seq_mean(...)); "
                          f"seq_{f.name[len('group_'):]} orders a sequence's tokens, "
                          f"batch_{f.name[len('group_'):]} the batch's")
            return None
        if len(args) == 2:
            k = args[1]
            if k.rank > 0:
                self.add(f"{f.name}'s k must be one number [], got {_shape(k.rank)}", k.node.span,
                         hint=f"e.g. {f.name}(x, 2) or {f.name}(x, G / 2); k counts the entries kept")
                return None
            if k.const is not None and float(k.const) < 0:
                self.add(f"{f.name}'s k must be >= 0, got {_num(k.const)}", k.node.span,
                         hint="k counts the entries kept")
                return None
        rank = {"seq": 2, "group": 1}.get(f.scope, max(x.rank, 1))
        kind = "bool" if len(args) == 2 else "num"
        return Typed(e, kind, rank, None, "call", f.name, args)

    # -- bounded searches -----------------------------------------------------------------

    def scalar(self, t: Typed | None, what: str, hint: str) -> bool:
        """``t`` is one number []: a search's bound, step count or candidate."""
        if t is None or not self.number(t, what):
            return False
        if t.rank > 0:
            self.add(f"{what} must be one number [], got {_shape(t.rank)}", t.node.span,
                     hint=hint)
            return False
        return True

    def search(self, e: Call, f: lang.Function) -> Typed | None:
        """``x = bisect(lo, hi, steps, cond)`` / ``x = first_of([c1, ...], cond)``: the binding's
        name(s) are the searched variable(s), visible in cond only; everything else is one number
        [] and the number of steps is a constant (the bound of the search)."""
        cur = self.current
        usage = ("x = bisect(lo, hi, steps, cond): e.g. t = bisect(0, 1, 30, batch_mean(where(v > t, 1, 0)) <= 0.1)"
                 if f.name == "bisect" else
                 "x = first_of([c1, c2, ...], cond): e.g. eps = first_of([0.3, 0.2, 0.1], batch_mean(where("
                 "abs(rho - 1) > eps, 1, 0)) <= 0.1)")
        if cur is None or cur.expr is not e:
            self.add(f"{f.name}(...) must be the whole right side of a binding", e.span,
                     hint="the binding's name is the searched variable: write it on a line of its own, "
                          f"then use its name; {usage}")
            return None
        names = cur.names
        want = f.arity[0]
        if len(e.args) != want:
            what = ("lo, hi, a constant number of steps and a condition" if f.name == "bisect" else
                    "the list of candidates and a condition")
            self.add(f"{f.name} takes {want} arguments ({what}), got {len(e.args)}", e.span,
                     hint="a search is bounded: " + usage)
            return None
        if f.name == "bisect":
            if len(names) > 1:
                self.add("bisect searches one number: bind one name", e.span, hint=usage)
                return None
            lo, hi, steps = (self.expr(a) for a in e.args[:3])
            ok = all([self.scalar(lo, "bisect's lo", _REDUCE_FIRST + "batch_min(...)"),
                      self.scalar(hi, "bisect's hi", _REDUCE_FIRST + "batch_max(...)"),
                      self.steps(steps)])
            if not ok:
                return None
            assert lo is not None and hi is not None and steps is not None
            if lo.const is not None and hi.const is not None and float(lo.const) > float(hi.const):
                self.add(f"bisect's bracket is empty: lo {_num(lo.const)} is above hi {_num(hi.const)}", e.span,
                         hint=usage)
                return None
            bounds: tuple[Typed, ...] = (lo, hi, steps)
        else:
            got = self.candidates(e.args[0], names, usage)
            if got is None:
                return None
            bounds = got
        self.bound = frozenset(names)
        try:
            cond = self.expr(e.args[-1])
        finally:
            self.bound = frozenset()
        if cond is None:
            return None
        if cond.kind != "bool":
            self.add(f"{f.name}'s condition must be a comparison (true/false), got a number", cond.node.span,
                     hint=usage)
            return None
        if cond.rank > 0:
            self.add(f"{f.name}'s condition must be one true/false [], got {_shape(cond.rank)}", cond.node.span,
                     hint="a search decides one number for the batch: reduce the condition's values first, "
                          "e.g. batch_mean(where(..., 1, 0)) <= 0.1")
            return None
        if not any(t.op == "bound" for t in _walk_typed(cond)):
            self.add(f"{f.name}'s condition does not read {' or '.join(repr(n) for n in names)}", cond.node.span,
                     hint="the binding's name is the value tried: the condition says when it is good enough")
            return None
        return Typed(e, "num", 0, None, "search", f.name, bounds + (cond,), names.index(cur.name))

    def steps(self, t: Typed | None) -> bool:
        if not self.scalar(t, "bisect's step count", "the number of steps is a constant, e.g. 30"):
            return False
        assert t is not None
        if t.const is None:
            self.add("bisect's step count must be a constant: a search runs a fixed number of steps", t.node.span,
                     hint="e.g. bisect(lo, hi, 30, cond): each step halves the bracket")
            return False
        n = float(t.const)
        if not n.is_integer() or not 1 <= n <= lang.MAX_STEPS:
            self.add(f"bisect's step count must be a whole number from 1 to {lang.MAX_STEPS}, got {_num(n)}",
                     t.node.span, hint=f"{lang.MAX_STEPS} halvings reach a float64's resolution")
            return False
        return True

    def candidates(self, node: Expr, names: tuple[str, ...], usage: str) -> tuple[Typed, ...] | None:
        """The candidates of a first_of, one after the other (each tuple's numbers in order)."""
        if not isinstance(node, List):
            self.add("first_of's first argument must be the list of candidates [c1, c2, ...]", node.span,
                     hint="the list bounds the search: " + usage)
            return None
        if not 1 <= len(node.items) <= lang.MAX_STEPS:
            self.add(f"first_of takes 1 to {lang.MAX_STEPS} candidates, got {len(node.items)}", node.span,
                     hint=usage)
            return None
        out: list[Typed] = []
        for item in node.items:
            if len(names) > 1:
                if not isinstance(item, Tuple) or len(item.items) != len(names):
                    self.add(f"each candidate is a tuple of {len(names)} numbers ({', '.join(names)})", item.span,
                             hint=f"{', '.join(names)} = first_of([(...), (...)], cond)")
                    return None
                parts = item.items
            elif isinstance(item, Tuple):
                self.add("a tuple candidate binds several names", item.span,
                         hint=f"write `a, b = first_of([(a1, b1), ...], cond)`; here the line binds {names[0]}")
                return None
            else:
                parts = (item,)
            for p in parts:
                t = self.expr(p)
                if not self.scalar(t, "a candidate", _REDUCE_FIRST + "batch_mean(...)"):
                    return None
                assert t is not None
                out.append(t)
        return tuple(out)

    def unknown_function(self, e: Call) -> None:
        name = e.func
        if name in lang.UNSCOPED_ORDER:
            op = {"argsort": "rank", "topk": "topk_mask", "cumulative_sum": "cumsum", "sorted": "sort",
                  "order": "rank"}.get(name, name)
            self.add(f"{name}(...) over every entry would order padding", e.span,
                     hint=f"order operations are masked and say what they order: seq_{op} (each "
                          f"sequence's tokens), group_{op} (each group's sequences), batch_{op} (the batch)")
            return
        base = name[:-1] if name.endswith("s") and name[:-1] in lang.UNSCOPED else name
        if base in lang.UNSCOPED or (name in ("max", "min") and len(e.args) == 1):
            r = {"avg": "mean", "var": "std", "median": "quantile", "count": "sum"}.get(base, base)
            self.add(f"{name}(...) over every entry would read padding", e.span,
                     hint=f"reductions are masked and say what they reduce: seq_{r} (each sequence's "
                          f"tokens), group_{r} (each group's sequences), batch_{r} (the batch)")
            return
        if name in lang.ALIASES and lang.ALIASES[name]:
            hint: str | None = f"did you mean {lang.ALIASES[name]!r}?"
        elif name in lang.ALIASES:
            hint = "write it with the operators: x^y, exp(x * log(2)), ..."
        else:
            hint = did_you_mean(name, lang.FUNCTIONS)
        if hint is None and self.resolve(name) != "unknown":
            hint = f"'{name}' is a value, not a function"
        self.add(f"unknown function '{name}'", e.func_span,
                 hint=hint or "functions: " + lang.function_list())


_REDUCE_FIRST = "a search decides one number for the batch; reduce it first, e.g. "


def _compare(op: str, a: float | bool, b: float | bool) -> bool:
    return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b, "!=": a != b}[op]


def _arith(op: str, a: float, b: float) -> float:
    try:
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "/":
            return a / b
        return float(a ** b) if not (a < 0 and not b.is_integer()) else math.nan
    except (OverflowError, ZeroDivisionError, ValueError):
        return math.inf


_MATH: dict[str, Callable[[float], float]] = {
    "exp": math.exp, "log": math.log, "tanh": math.tanh, "abs": abs, "sqrt": math.sqrt, "lgamma": math.lgamma,
    "sign": lambda x: float((x > 0) - (x < 0)),
    "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x)),
}


def _fold(f: lang.Function, xs: list[float]) -> float | None:
    """The value of a function of constants (None: no finite value)."""
    try:
        if f.kind == "elementwise":
            v = _MATH[f.name](xs[0])
        elif f.kind == "minmax":
            v = min(xs) if f.name == "min" else max(xs)
        elif f.kind == "clamp":
            v = min(max(xs[0], xs[1]), xs[2])
        else:  # sg
            v = xs[0]
    except (ValueError, OverflowError):
        return None
    return float(v) if math.isfinite(v) else None


# ---------------------------------------------------------------------------------------
# A define used in a slot


def check_use(slot: str, define: Define, args: tuple, use_span: Span, file: str,
              errors: ErrorList, reported: set[tuple[str, Span]]) -> Formula | None:
    """Check ``define`` as the component of ``slot`` with the slot line's ``args``."""
    add = _Reporter(errors, reported)
    spec = lang.formula_slot(slot)
    if spec is None:
        why = lang.NOT_FORMULAS.get(slot)
        add(f"slot '{slot}' cannot take a formula" + (f": {why}" if why else ""), use_span,
            hint="formulas fill: " + ", ".join(lang.SLOTS))
        return None
    outputs = {o.name for o in spec.outputs}
    bindings: dict[str, Binding] = {}
    defaults: dict[str, float] = {}
    for b in define.bindings:
        if b.name in bindings:
            first = bindings[b.name].name_span
            add(f"'{b.name}' is bound twice in define {define.name}", b.name_span,
                hint=f"first bound at line {first.line}, column {first.column}")
            continue
        if not _BINDING_NAME.fullmatch(b.name):
            add(f"binding name '{b.name}' must start with a letter", b.name_span)
            continue
        if b.name in lang.FUNCTIONS:
            add(f"'{b.name}' is a function; a binding cannot take its name", b.name_span)
            continue
        if b.targets and not (isinstance(b.expr, Call) and b.expr.func == "first_of"):
            add(f"only a search over candidate tuples binds several names ({', '.join(b.targets)})",
                b.expr.span, hint=f"{', '.join(b.targets)} = first_of([(...), (...)], cond); "
                "otherwise one `name = expression` per line")
            continue
        if b.name in spec.inputs and b.name not in outputs:
            add(f"'{b.name}' is an input of {slot}; a binding cannot take its name", b.name_span,
                hint="choose another name")
            continue
        bindings[b.name] = b
        if literal_number(b.expr) and b.name not in outputs:
            num = b.expr if isinstance(b.expr, Num) else b.expr.operand  # type: ignore[union-attr]
            value = float(num.text)
            if not math.isfinite(value):
                add(f"the number {num.text} is not finite", num.span)
                continue
            defaults[b.name] = -value if isinstance(b.expr, Neg) else value
    params = dict(defaults)
    seen_args: dict[str, Span] = {}
    group_by: tuple[str, Span] | None = None
    for arg in args:
        an = arg.name.text
        if an == GROUP_BY and an not in defaults:
            if group_by is not None:
                add(f"argument '{an}' is given twice", arg.name.span)
            elif arg.kind != "word":
                add(f"group_by takes the name of a data field, got {arg.value.text!r}", arg.value.span,
                    hint="e.g. group_by=role")
            elif spec.stage != "advantage":
                add(f"group_by groups rows in the advantage stage; {slot} runs in loss()", arg.name.span,
                    hint="group_by fills " + ", ".join(n for n, s in lang.SLOTS.items() if s.stage == "advantage"))
            else:
                group_by = (arg.value.text, arg.name.span)
            continue
        if an not in defaults:
            if defaults:
                hint = did_you_mean(an, defaults) or f"{slot} {define.name} takes: " + ", ".join(defaults)
            else:
                hint = f"{slot} {define.name} takes no arguments (a binding to a number is a parameter)"
            add(f"unknown argument '{an}' for {slot} {define.name}", arg.name.span, hint=hint)
            continue
        if an in seen_args:
            first = seen_args[an]
            add(f"argument '{an}' is given twice", arg.name.span,
                hint=f"first given at line {first.line}, column {first.column}")
            continue
        seen_args[an] = arg.name.span
        value = _override(arg, define, defaults, add)
        if value is not None:
            params[an] = value
    for p in spec.params:  # parameters the slot itself needs
        if p not in bindings:
            add(f"a {slot} formula needs a parameter '{p}'", use_span,
                hint=f"add a line `{p} = ...` to define {define.name} (the coefficient of the KL term)")
        elif p not in defaults:
            add(f"'{p}' must be a number (a parameter)", bindings[p].expr.span)  # type: ignore[union-attr]
        elif params[p] < 0:
            span = seen_args.get(p, bindings[p].name_span)
            add(f"parameter '{p}' of {slot} {define.name} must be >= 0, got {_num(params[p])}", span)
    # outputs
    bound = [o.name for o in spec.outputs if o.name in bindings]
    if spec.one_of and len(bound) != 1:
        if not bound:
            add(f"a {slot} formula binds one of " + " or ".join(f"'{o.name}' ({o.doc})" for o in spec.outputs),
                use_span, hint=f"add a line to define {define.name}, e.g. `{spec.outputs[0].name} = ...`")
        else:
            b2 = bindings[bound[1]]
            add(f"a {slot} formula binds '{bound[0]}' or '{bound[1]}', not both", b2.name_span)
        return None
    missing = [] if spec.one_of else [o for o in spec.outputs if o.name not in bindings]
    for o in missing:
        add(f"a {slot} formula must bind '{o.name}' ({o.doc} {_shape(o.rank)})", use_span,
            hint=f"add a line to define {define.name}: `{o.name} = ...`")
    if missing:
        return None
    checker = _Checker(slot, define, add, params)
    checker.bindings = {n: b for n, b in bindings.items() if n not in defaults}
    order = _order(checker, bound, add)
    if order is None:
        return None
    before = add.count
    for name in order:
        checker.current = checker.bindings[name]
        t = checker.expr(checker.bindings[name].expr)
        checker.current = None
        if t is not None:
            checker.typed[name] = t
    if add.count != before:
        return None
    # unused parameters and bindings
    used_params = {n.name for name in order for n in walk(checker.bindings[name].expr)
                   if isinstance(n, Name) and n.name in defaults and checker.resolve(n.name) == "param"}
    # K sizes the top-K inputs a formula reads: used by reading them
    if any(t.op == "input" and t.rank == lang.TOPK_RANK for name in order for t in _walk_typed(checker.typed[name])):
        used_params.add(TOPK_PARAM)
    for name, b in bindings.items():
        if name in defaults and name not in used_params and name not in spec.params:
            add(f"parameter '{name}' is never used", b.name_span,
                hint="remove it, or use it in the formula")
        elif name not in defaults and name not in order:
            add(f"'{name}' is never used", b.name_span,
                hint=f"the {slot} formula's result is " + " and ".join(o.name for o in spec.outputs))
    for o in spec.outputs:
        if o.name not in checker.typed:
            continue
        t = checker.typed[o.name]
        if t.kind != o.kind:
            add(f"'{o.name}' must be {_kind_words(o.kind)}, got {_kind_words(t.kind)}", t.node.span,
                hint="e.g. keep = L < 4096" if o.kind == "bool" else "turn a condition into numbers with "
                "where(condition, 1, 0)")
        elif t.rank > o.rank:
            hint = ("reduce the top-K axis, e.g. k_sum(...) or k_max(...)" if t.rank == lang.TOPK_RANK else
                    "reduce each sequence's tokens, e.g. seq_mean(...) or seq_sum(...)" if o.rank == 1
                    else "reduce it over the group's samples: sum(...), mean(...), max(...) or min(...)"
                    if spec.plain_scope else "reduce it, e.g. batch_sum(...)")
            words = (f"one number per group [], got {_shape(t.rank)} (a value per sample of the group)"
                     if spec.plain_scope else f"{_shape_words(o.rank)}, got {_shape(t.rank)}")
            add(f"'{o.name}' must be {words}", t.node.span, hint=hint)
    if add.count != before:
        return None
    reads = frozenset(t.name for name in order for t in _walk_typed(checker.typed[name]) if t.op == "input")
    if not _topk_size(define, reads, params, defaults, bindings, seen_args, use_span, add):
        return None
    f = Formula(define.name, slot, define, file, params, defaults, tuple(order), dict(checker.typed),
                tuple(bound), reads, group_by[0] if group_by else None)
    if group_by is not None and not f.uses_group_functions:
        add(f"group_by={group_by[0]} changes what group_* functions compare, and define {define.name} calls none",
            group_by[1], hint="compare rows with group_mean(r), group_std(r), ... or drop group_by")
        return None
    return f


#: the parameter that sizes the K axis of a formula reading the policy's top-K inputs
TOPK_PARAM = "K"
#: the largest K (the old forward keeps [B, T, K] logprobs and ids of every row)
MAX_TOPK = 1024


def _topk_size(define: Define, reads: frozenset[str], params: dict[str, float], defaults: dict[str, float],
               bindings: dict[str, Binding], seen_args: dict[str, Span], use_span: Span, add: _Reporter) -> bool:
    """A formula reading a [B, T, K] input says how many candidates: its parameter ``K``, a whole
    number from 1 to MAX_TOPK (the runtime's forwards compute that many; every formula of a spec
    reading them gives the same K: spec.py's rule)."""
    if not any(lang.INPUTS[r].rank == lang.TOPK_RANK for r in reads):
        return True
    topk = sorted(r for r in reads if lang.INPUTS[r].rank == lang.TOPK_RANK)
    if TOPK_PARAM not in defaults:
        at = bindings[TOPK_PARAM].name_span if TOPK_PARAM in bindings else use_span
        add(f"define {define.name} reads {', '.join(topk)} [B, T, K]: it needs a parameter '{TOPK_PARAM}' "
            "(how many of the policy's most likely tokens)", at,
            hint=f"add a line `{TOPK_PARAM} = 8` to define {define.name} (a whole number from 1 to {MAX_TOPK})")
        return False
    k = params[TOPK_PARAM]
    if not (float(k).is_integer() and 1 <= k <= MAX_TOPK):
        span = seen_args.get(TOPK_PARAM, bindings[TOPK_PARAM].expr.span)
        add(f"'{TOPK_PARAM}' (the top-K size of define {define.name}) must be a whole number from 1 to "
            f"{MAX_TOPK}, got {_num(k)}", span, hint=f"e.g. {TOPK_PARAM} = 8")
        return False
    return True


def _shape_words(rank: int) -> str:
    return {0: "one number []", 1: "one value per sequence [B]", 2: "a value per token [B, T]"}[rank]


def _order(c: _Checker, outputs: list[str], add: _Reporter) -> list[str] | None:
    """The bindings the outputs need, dependencies first; a cycle is an error."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def deps(name: str) -> list[str]:
        out = []
        b = c.bindings[name]
        searched: set[int] = set()  # the searched names inside a search's condition: not references
        if isinstance(b.expr, Call) and b.expr.args and getattr(lang.FUNCTIONS.get(b.expr.func), "kind", "") == "search":
            searched = {id(n) for n in walk(b.expr.args[-1]) if isinstance(n, Name) and n.name in b.names}
        for n in walk(b.expr):
            if id(n) in searched:
                continue
            if isinstance(n, Name) and n.name in c.bindings and c.resolve(n.name) == "binding":
                if n.name == name:
                    add(f"'{name}' is defined in terms of itself", n.span)
                    continue
                out.append(n.name)
        return out

    def visit(name: str, path: list[str]) -> bool:
        if state.get(name) == 2:
            return True
        if state.get(name) == 1:
            cycle = path[path.index(name):]  # ends with name again
            add(f"'{name}' depends on itself: " + " -> ".join(cycle), c.bindings[name].name_span)
            return False
        state[name] = 1
        ok = all(visit(d, path + [d]) for d in deps(name))
        state[name] = 2
        order.append(name)
        return ok

    before = add.count
    for o in outputs:
        visit(o, [o])
    return order if add.count == before else None
