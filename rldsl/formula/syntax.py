"""Lark tree -> formula nodes, and the words for syntax errors inside a ``define`` block.

:class:`FormulaNodes` is mixed into the spec parser's Transformer: its methods are named
after the formula rules of ``grammar/rl.lark`` (``define``, ``binding``, ``f_*``). Positions
come from Lark's propagated ``meta``; a binding is one line, so every span is on one line.
"""
from __future__ import annotations

from typing import Any

from lark import Token, v_args

from ..errors import Span, source_lines
from .nodes import Binary, Binding, Call, Define, FunctionDef, List, Name, Neg, Num, Tuple

# terminals that only occur in formulas (outside a define they are "unexpected characters")
OPERATOR_TERMINALS = {"PLUS": "+", "MINUS": "-", "STAR": "*", "SLASH": "/", "CIRCUMFLEX": "^",
                      "COMPARE": None, "LSQB": "[", "RSQB": "]"}
FORMULA_TERMINALS = set(OPERATOR_TERMINALS) | {"NUMBER", "END"}
# terminals an "expected ..." message leaves out: a list only holds a search's candidates
UNMENTIONED = frozenset({"LSQB"})
TERMINAL_WORDS = {"NUMBER": "a number", "COMPARE": "a comparison", "END": "'end'", "DEFINE": "'define'"}


class FormulaNodes:
    """Transformer methods for the formula rules (mixed into the spec's ``_ToNodes``)."""

    file: str

    def _span(self, meta: Any) -> Span:
        return Span(self.file, meta.line, meta.column, max(1, meta.end_column - meta.column))

    def _tspan(self, tok: Token) -> Span:
        return Span(self.file, tok.line or 0, tok.column or 0, max(1, len(str(tok))))

    def define(self, items: list[Any]) -> tuple[str, Define]:
        name = items[0]
        bindings = tuple(b for group in items[1:] if isinstance(group, tuple) for b in group)
        return "define", Define(str(name), self._tspan(name), bindings, self._tspan(name))

    def function(self, items: list[Any]) -> tuple[str, FunctionDef]:
        name, *params, expr = items
        return "function", FunctionDef(str(name), self._tspan(name), tuple(str(p) for p in params),
                                       tuple(self._tspan(p) for p in params), expr)

    def binding(self, items: list[Any]) -> tuple[Binding, ...]:
        names, expr = items[:-1], items[-1]
        targets = tuple(str(n) for n in names) if len(names) > 1 else ()
        return tuple(Binding(str(n), self._tspan(n), expr, targets) for n in names)

    @v_args(meta=True)
    def f_list(self, meta: Any, items: list[Any]) -> List:
        return List(tuple(i for i in items if i is not None), self._span(meta))

    @v_args(meta=True)
    def f_tuple(self, meta: Any, items: list[Any]) -> Tuple:
        return Tuple(tuple(items), self._span(meta))

    @v_args(meta=True)
    def f_number(self, meta: Any, items: list[Token]) -> Num:
        return Num(str(items[0]), self._tspan(items[0]))

    @v_args(meta=True)
    def f_name(self, meta: Any, items: list[Token]) -> Name:
        return Name(str(items[0]), self._tspan(items[0]))

    @v_args(meta=True)
    def f_call(self, meta: Any, items: list[Any]) -> Call:
        return Call(str(items[0]), self._tspan(items[0]), tuple(items[1:]), self._span(meta))

    @v_args(meta=True)
    def f_neg(self, meta: Any, items: list[Any]) -> Neg:
        return Neg(items[0], self._span(meta))

    def _bin(self, op: str, meta: Any, items: list[Any]) -> Binary:
        return Binary(op, items[0], items[-1], self._span(meta))

    @v_args(meta=True)
    def f_add(self, meta: Any, items: list[Any]) -> Binary:
        return self._bin("+", meta, items)

    @v_args(meta=True)
    def f_sub(self, meta: Any, items: list[Any]) -> Binary:
        return self._bin("-", meta, items)

    @v_args(meta=True)
    def f_mul(self, meta: Any, items: list[Any]) -> Binary:
        return self._bin("*", meta, items)

    @v_args(meta=True)
    def f_div(self, meta: Any, items: list[Any]) -> Binary:
        return self._bin("/", meta, items)

    @v_args(meta=True)
    def f_pow(self, meta: Any, items: list[Any]) -> Binary:
        return self._bin("^", meta, items)

    @v_args(meta=True)
    def f_compare(self, meta: Any, items: list[Any]) -> Binary:
        return self._bin(str(items[1]), meta, items)


# ---------------------------------------------------------------------------------------
# Syntax errors


def shown(accepts: set[str]) -> set[str]:
    """The terminals a syntax error names: after a binding's name, '=' (the ',' of a search that
    binds several names, `a, b = first_of(...)`, is left out)."""
    return {"EQUAL"} if accepts == {"COMMA", "EQUAL"} else accepts


def in_define(source: str, line: int) -> bool:
    """Whether ``line`` (1-based) lies inside a ``define`` block (after `define`, before `end`)."""
    inside = False
    for i, text in enumerate(source_lines(source)[:max(line, 0)], start=1):
        code = text.split("#", 1)[0]
        words = code.split()
        if i == line:
            return inside or words[:1] == ["define"]
        if words[:1] == ["define"]:
            inside = "=" not in code  # `define f(x) = ...` is one line, not a block
        elif words == ["end"]:
            inside = False
    return inside


def outside_operator(tok: Token, accepts: set[str]) -> str | None:
    """The character of a formula operator met where no formula can be: reported as before
    formulas existed, as an unexpected character."""
    if tok.type in OPERATOR_TERMINALS and not (accepts & FORMULA_TERMINALS):
        return str(tok)[:1]
    if tok.type in ("LSQB", "RSQB") and tok.type not in accepts:  # a list stands only as a search's candidates
        return str(tok)[:1]
    return None


def hint(tok: Token, accepts: set[str], before: str) -> str | None:
    """A hint for a syntax error inside a define block (None: no specific advice)."""
    text = str(tok)
    line_before = before.rsplit("\n", 1)[-1].split("#", 1)[0]
    if tok.type == "$END" and "END" in accepts:
        return "close the define block with a line `end`"
    if tok.type == "STAR" and line_before.endswith("*"):
        return "a power is written x^2"
    if tok.type == "STRING":
        return "a formula holds numbers, names, operators and calls; no strings"
    if tok.type == "EQUAL":
        return "a comparison is written == (a binding is one `name = expression` per line)"
    if tok.type == "COMPARE":
        return "comparisons do not chain: combine conditions with where(...)"
    if tok.type == "NAME" and text in ("and", "or", "not", "if", "else"):
        return f"there is no '{text}': choose between values with where(condition, a, b)"
    if tok.type in ("_NL", "$END") and "RPAR" in accepts:
        return "close the parenthesis before `end` (a binding goes on over the next lines while one is open)"
    if tok.type in ("_NL", "$END") and ("NUMBER" in accepts or "NAME" in accepts) and "EQUAL" not in accepts:
        return "the expression is incomplete"
    if tok.type == "NAME" and accepts == {"EQUAL"}:
        return "a define block holds `name = expression` lines and ends with a line `end`"
    if "EQUAL" in accepts:
        return "a binding is written `name = expression`"
    return None
