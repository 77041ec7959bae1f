"""Syntax nodes of the formula sub-language: plain frozen records that remember their place.

A ``define NAME ... end`` block holds one binding per line; each binding is an expression
tree of numbers, names, calls and operators. Every node carries the :class:`Span` of its
text so that the checker can put a caret under the offending sub-expression.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..errors import Span


@dataclass(frozen=True)
class Num:
    """A numeric literal as written (``text``); its value is read by the checker."""

    text: str
    span: Span


@dataclass(frozen=True)
class Name:
    """A reference to an input, a parameter or another binding."""

    name: str
    span: Span


@dataclass(frozen=True)
class Call:
    """``func(args...)``: a function from the closed table (checked later)."""

    func: str
    func_span: Span
    args: tuple["Expr", ...]
    span: Span


@dataclass(frozen=True)
class Neg:
    """Unary minus."""

    operand: "Expr"
    span: Span


@dataclass(frozen=True)
class Binary:
    """``left op right``; op is one of + - * / ^ < <= > >= == !=."""

    op: str
    left: "Expr"
    right: "Expr"
    span: Span


@dataclass(frozen=True)
class List:
    """``[a, b, ...]``: the candidates of a ``first_of`` search (nowhere else)."""

    items: tuple["Expr", ...]
    span: Span


@dataclass(frozen=True)
class Tuple:
    """``(a, b, ...)``: one candidate of a ``first_of`` search that binds several names."""

    items: tuple["Expr", ...]
    span: Span


Expr = Union[Num, Name, Call, Neg, Binary, List, Tuple]

ARITHMETIC = ("+", "-", "*", "/", "^")
COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")


@dataclass(frozen=True)
class Binding:
    """``name = expr`` on one line of a define block. A line ``a, b = first_of(...)`` binds
    several names: it becomes one Binding per name, each with the line's names as ``targets``
    (and the same ``expr``)."""

    name: str
    name_span: Span
    expr: Expr
    targets: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The names the line binds (the variables a search binds: visible in its condition)."""
        return self.targets or (self.name,)


@dataclass(frozen=True)
class Define:
    """``define name`` ... ``end``: a component written in the spec."""

    name: str
    name_span: Span
    bindings: tuple[Binding, ...]
    end_span: Span


@dataclass(frozen=True)
class FunctionDef:
    """``define name(a, b) = expr``: a function written in the spec, usable in any formula of the
    file; a call is replaced by ``expr`` with the arguments put in for the parameters."""

    name: str
    name_span: Span
    params: tuple[str, ...]
    param_spans: tuple[Span, ...]
    expr: Expr


def children(e: Expr) -> tuple[Expr, ...]:
    """The direct sub-expressions of ``e``."""
    if isinstance(e, (Call, List, Tuple)):
        return e.args if isinstance(e, Call) else e.items
    if isinstance(e, Neg):
        return (e.operand,)
    if isinstance(e, Binary):
        return (e.left, e.right)
    return ()


def walk(e: Expr):  # noqa: ANN201 - a generator of Expr
    """``e`` and every sub-expression, parents first."""
    yield e
    for c in children(e):
        yield from walk(c)


def literal_number(e: Expr) -> bool:
    """A plain number, possibly negated: what makes a binding a parameter."""
    return isinstance(e, Num) or (isinstance(e, Neg) and isinstance(e.operand, Num))
