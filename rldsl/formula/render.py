"""Formula nodes -> text, with the fewest parentheses: what `rldsl explain`, diffs and the
comments of the generated code show. Rendered from the tree, never copied from the file."""
from __future__ import annotations

from typing import Mapping

from .nodes import Binary, Binding, Call, Expr, List, Name, Neg, Num, Tuple

_PREC = {"<": 1, "<=": 1, ">": 1, ">=": 1, "==": 1, "!=": 1, "+": 2, "-": 2, "*": 3, "/": 3, "^": 5}
_NEG = 4
_ATOM = 6


def number(x: float) -> str:
    """A parameter value as the spec would write it."""
    return repr(float(x))


def render(e: Expr, values: Mapping[str, float] | None = None) -> str:
    """``e`` as text; names in ``values`` (parameters) are replaced by their numbers."""
    return _r(e, values or {})[0]


def _r(e: Expr, values: Mapping[str, float]) -> tuple[str, int]:
    if isinstance(e, Num):
        return e.text, _ATOM
    if isinstance(e, Name):
        if e.name in values:
            text = number(values[e.name])
            return text, (_NEG if text.startswith("-") else _ATOM)
        return e.name, _ATOM
    if isinstance(e, Call):
        return f"{e.func}(" + ", ".join(_r(a, values)[0] for a in e.args) + ")", _ATOM
    if isinstance(e, List):
        return "[" + ", ".join(_r(a, values)[0] for a in e.items) + "]", _ATOM
    if isinstance(e, Tuple):
        return "(" + ", ".join(_r(a, values)[0] for a in e.items) + ")", _ATOM
    if isinstance(e, Neg):
        inner, p = _r(e.operand, values)
        return "-" + (inner if p > _NEG else f"({inner})"), _NEG
    assert isinstance(e, Binary)
    p = _PREC[e.op]
    left, lp = _r(e.left, values)
    right, rp = _r(e.right, values)
    if e.op == "^":  # right-associative
        left = left if lp > p else f"({left})"
        right = right if rp >= _NEG else f"({right})"
    else:
        left = left if lp >= p else f"({left})"
        right = right if rp > p else f"({right})"
    return f"{left} {e.op} {right}", p


def binding(b: Binding, values: Mapping[str, float] | None = None) -> str:
    return f"{', '.join(b.names)} = {render(b.expr, values)}"
