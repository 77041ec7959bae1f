"""Functions written in a spec: ``define logbeta(a, b) = lgamma(a) + lgamma(b) - lgamma(a + b)``.

A function is a named expression with parameters, usable in every formula of its file. It
adds no power to the language: a call is replaced by the function's expression with the
arguments put in for the parameters (before the formula is checked), so what the checker
types and the emitter writes is exactly the formula written out by hand. A function reads
only its parameters (no inputs, no bindings: what it needs is passed), calls the table's
functions and the file's other functions, never itself (directly or through others). An
expansion is bounded like a written formula: at most ``MAX_DEPTH`` levels and
``MAX_NODES`` terms, refused at the call that passes either.
"""
from __future__ import annotations

import re
from dataclasses import replace

from ..errors import ErrorList, Span
from ..suggest import did_you_mean
from . import lang
from .nodes import Binary, Call, Define, Expr, FunctionDef, List, Name, Neg, Num, Tuple, children, walk

_NAME = re.compile(r"[a-z][a-z0-9_]*")
#: how deep an expanded formula may nest (the parser's limit for a written one)
MAX_DEPTH = 200
#: how many terms a formula may have once its calls are expanded
MAX_NODES = 20_000


def table(functions: list[FunctionDef], errors: ErrorList) -> dict[str, FunctionDef]:
    """The file's functions by name, each checked on its own: its name, its parameters, that it
    reads only them and calls only known functions, and no cycle of calls. A bad one is reported
    and left out."""
    out: dict[str, FunctionDef] = {}
    for fn in functions:
        if not _NAME.fullmatch(fn.name):
            errors.add(f"function name '{fn.name}' must start with a lower case letter, then lower case "
                       "letters, digits or '_'", fn.name_span)
        elif fn.name in out:
            errors.add(f"function '{fn.name}' is given twice", fn.name_span,
                       hint=f"first given at line {out[fn.name].name_span.line}")
        elif fn.name in lang.FUNCTIONS or fn.name in lang.SEARCHES:
            errors.add(f"function '{fn.name}' has the name of a built-in function", fn.name_span,
                       hint="give the function its own name")
        elif _params_ok(fn, errors):
            out[fn.name] = fn
    names = set(out)
    declared = {fn.name for fn in functions}  # a call of a function refused above is not "unknown" too
    for fn in list(out.values()):
        for e in walk(fn.expr):
            if isinstance(e, Name) and e.name not in fn.params:
                errors.add(f"function '{fn.name}' reads '{e.name}', which is not one of its parameters "
                           f"({', '.join(fn.params)})", e.span,
                           hint="a function reads only its parameters: pass the value as an argument")
                out.pop(fn.name, None)
            elif isinstance(e, Call) and e.func not in lang.FUNCTIONS and e.func not in declared:
                errors.add(f"unknown function '{e.func}'", e.func_span,
                           hint=did_you_mean(e.func, [*lang.FUNCTIONS, *names]) or
                           "functions: " + lang.function_list())
                out.pop(fn.name, None)
            elif isinstance(e, Call) and e.func in lang.FUNCTIONS and lang.FUNCTIONS[e.func].kind == "search":
                errors.add(f"a function cannot hold a search ({e.func})", e.func_span,
                           hint="a search is the whole right side of a binding in a define block")
                out.pop(fn.name, None)
    for fn in list(out.values()):
        cycle = _cycle(fn.name, out)
        if cycle:
            errors.add(f"function '{fn.name}' calls itself: {' -> '.join(cycle)}", fn.name_span,
                       hint="a function is expanded where it is called: it cannot recurse")
    for fn in [f for f in out.values() if _cycle(f.name, out)]:
        del out[fn.name]
    return out


def _params_ok(fn: FunctionDef, errors: ErrorList) -> bool:
    seen: set[str] = set()
    for p, span in zip(fn.params, fn.param_spans):
        if p in seen:
            errors.add(f"function '{fn.name}' has parameter '{p}' twice", span)
            return False
        seen.add(p)
    return True


def _cycle(start: str, fns: dict[str, FunctionDef]) -> list[str]:
    """The first cycle of calls through ``start`` ([] if none), found without recursion."""
    stack = [(start, [start])]
    seen: set[str] = set()
    while stack:
        name, path = stack.pop()
        for e in walk(fns[name].expr):
            if isinstance(e, Call) and e.func in fns:
                if e.func == start:
                    return path + [start]
                if e.func not in seen:
                    seen.add(e.func)
                    stack.append((e.func, path + [e.func]))
    return []


def used(defines: dict[str, Define], functions: dict[str, FunctionDef]) -> set[str]:
    """The functions some formula calls, directly or through another function."""
    todo = [e.func for d in defines.values() for b in d.bindings for e in walk(b.expr)
            if isinstance(e, Call) and e.func in functions]
    out: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo += [e.func for e in walk(functions[name].expr) if isinstance(e, Call) and e.func in functions]
    return out


def expand(define: Define, functions: dict[str, FunctionDef], errors: ErrorList) -> Define:
    """``define`` with every call of a file function replaced by its expression (the arguments
    in place of the parameters). A call with the wrong number of arguments, or one whose
    expansion passes the limits, is reported at the call."""
    if not functions:
        return define
    bindings = []
    for b in define.bindings:
        if not any(isinstance(e, Call) and e.func in functions for e in walk(b.expr)):
            bindings.append(b)
            continue
        ex = _Expander(functions, errors)
        expanded = ex.expr(b.expr, {}, 0)
        first_call = next(e.span for e in walk(b.expr) if isinstance(e, Call) and e.func in functions)
        too_large = ex.too_large or (None if _within_limits(expanded) else first_call)
        if too_large is None:
            bindings.append(replace(b, expr=expanded))
            continue
        errors.add(f"the calls of this binding expand to a formula larger than the limit "
                   f"({MAX_DEPTH} levels, {MAX_NODES} terms)", too_large,
                   hint="bind the function's result once and reuse the name, instead of nesting calls")
        bindings.append(replace(b, expr=Num("0", too_large)))  # reported: no "unknown function" besides
    return replace(define, bindings=tuple(bindings))


class _Expander:
    def __init__(self, functions: dict[str, FunctionDef], errors: ErrorList):
        self.functions = functions
        self.errors = errors
        self.nodes = 0
        self.outer: Span | None = None      # the outermost call being expanded
        self.too_large: Span | None = None  # where the expansion passed the limits (it then stops)

    def expr(self, e: Expr, env: dict[str, Expr], depth: int) -> Expr:
        self.nodes += 1
        if self.too_large is not None or depth > MAX_DEPTH or self.nodes > MAX_NODES:
            self.too_large = self.too_large or self.outer or e.span
            return e
        if isinstance(e, Name):
            return env.get(e.name, e)
        if isinstance(e, Num):
            return e
        if isinstance(e, Neg):
            return replace(e, operand=self.expr(e.operand, env, depth + 1))
        if isinstance(e, Binary):
            return replace(e, left=self.expr(e.left, env, depth + 1), right=self.expr(e.right, env, depth + 1))
        if isinstance(e, (List, Tuple)):
            return replace(e, items=tuple(self.expr(i, env, depth + 1) for i in e.items))
        assert isinstance(e, Call)
        args = tuple(self.expr(a, env, depth + 1) for a in e.args)
        fn = self.functions.get(e.func)
        if fn is None:
            return replace(e, args=args)
        if len(args) != len(fn.params):
            self.errors.add(f"{fn.name} takes {len(fn.params)} argument{'s' if len(fn.params) != 1 else ''}, "
                            f"got {len(args)}", e.func_span,
                            hint=f"define {fn.name}({', '.join(fn.params)}) at line {fn.name_span.line}")
            return Num("0", e.span)  # reported: the checker goes on with a plain number, not an unknown call
        outer = self.outer
        self.outer = outer or e.span
        try:
            return self.expr(fn.expr, dict(zip(fn.params, args)), depth + 1)
        finally:
            self.outer = outer


def _within_limits(e: Expr) -> bool:
    """Whether an expanded tree keeps within MAX_DEPTH levels and MAX_NODES terms (an argument
    used twice is walked twice, as the checker will): walked without recursion, stopping early."""
    stack, count = [(e, 1)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH or count > MAX_NODES:
            return False
        stack.extend((c, depth + 1) for c in children(node))
    return True
