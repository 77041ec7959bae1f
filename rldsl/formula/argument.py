"""A formula written as a component's argument: ``sampling replay(priority="std * sum(abs(adv))")``.

The quoted text is an expression of the formula language: it is parsed by the spec's own
grammar (a one-line binding of the argument's output), checked by :func:`check.check_use` as
the formula of :data:`lang.ARGUMENTS`'s slot (names from the inputs table, the closed function
table, shapes), with every error at its place inside the string (``file:line:col`` and a caret),
and compiled by the emitter into a function of one group's inputs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..errors import ErrorList, Span, SpecError
from ..generated import load_function
from ..parser import parse as parse_spec
from . import emit, lang
from .check import Formula, check_use
from .nodes import Binding, Define

# the spec a formula argument is parsed in: its text on the binding line, after this prefix
_HEAD = "algorithm argument\ndefine {slot}\n"
_LINE = 3  # the binding's line in that spec


def check(slot: str, text: str, at: Span, errors: ErrorList) -> Formula | None:
    """The formula ``text`` of argument ``slot`` (a key of ``lang.ARGUMENTS``), checked; ``at``
    is the span of its quoted string in the spec (errors point inside it). None: errors added."""
    spec = lang.ARGUMENTS[slot]
    out = spec.outputs[0].name
    prefix = f"{out} = "
    col0 = at.column + 1  # the column of the text's first character (after the opening quote)
    if "#" in text:  # the grammar would read the rest as a comment
        errors.add("unexpected character '#'", Span(at.file, at.line, col0 + text.index("#"), 1),
                   hint="a formula holds numbers, names, operators and calls")
        return None
    source = _HEAD.format(slot=slot) + prefix + text + "\nend\n"

    def moved(span: Span) -> Span:
        """A span of the parsed spec -> its place in the file (past the text: the text's end)."""
        if span.line != _LINE:
            return Span(at.file, at.line, col0 + len(text), 1)
        column = col0 + max(0, span.column - 1 - len(prefix))
        return Span(at.file, at.line, column, max(1, min(span.length, col0 + len(text) - column)))

    try:
        parsed = parse_spec(source, at.file)
    except SpecError as e:  # the hints about a define block's lines do not apply to one string
        hint = e.hint if e.hint and "`end`" not in e.hint and "binding" not in e.hint else None
        if hint is None and "')'" in e.message:
            hint = "close the parenthesis inside the quotes"
        errors.add(e.message, moved(e.span), hint=hint)
        return None
    expr = _relocated(parsed.defines[0].bindings[0].expr, moved)
    define = Define(slot, at, (Binding(out, at, expr),), at)
    return check_use(slot, define, (), at, at.file, errors, set())


def _relocated(node: Any, moved: Callable[[Span], Span]) -> Any:
    """``node`` (an expression tree) with every span moved."""
    if isinstance(node, Span):
        return moved(node)
    if isinstance(node, tuple):
        return tuple(_relocated(x, moved) for x in node)
    if dataclasses.is_dataclass(node):
        return dataclasses.replace(node, **{f.name: _relocated(getattr(node, f.name), moved)
                                            for f in dataclasses.fields(node)})
    return node


def function(f: Formula) -> Callable[..., Any]:
    """The checked formula as a function of its inputs by their formula names (0-dim tensor)."""
    return load_function(emit.group_function_source(f), "formula")


def formula(slot: str, text: str, file: str = "<argument>") -> Formula:
    """The checked formula of ``text`` outside a spec (a ValueError names its first error)."""
    errors = ErrorList()
    f = check(slot, text, Span(file, 1, 1, len(text) + 2), errors)
    if f is None:
        raise ValueError(errors.items[0].message if errors.items else f"bad {slot} formula {text!r}")
    return f


