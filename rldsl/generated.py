"""Generated Python: the one writer of literals into it and the one loader that runs it.

Both the templates (``codegen``) and the formula emitter (``formula/emit``) write numbers and
booleans through :func:`literal`, which refuses anything that is not a plain, finite
literal (or one of a registry parameter's own choice strings), so no text from a spec file
can become code. :func:`load_function` executes generated source in a closed namespace
(torch, the per-slot component namespaces, the masked reductions formulas compile to) and
registers it with ``linecache`` so tracebacks and ``inspect.getsource`` show it.

This module sits low in the language core: it imports the registry, ``ops`` and the
formula package's masked reductions, and nothing that builds an algorithm.
"""
from __future__ import annotations

import dataclasses
import hashlib
import linecache
import math
import re
from typing import Any, Callable

from . import lazy_torch, ops, registry
from .formula import masked

IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")


class CodegenError(RuntimeError):
    """A value that must never reach generated code did (a bug, not a user error)."""


def literal(value: Any, choices: tuple[str, ...] = ()) -> str:
    """Python source for a validated value; refuses anything that is not a plain literal.

    None, True/False, an int, a finite float (``repr``), or a string that is one of
    ``choices`` (a registry parameter's own) and an identifier.
    """
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CodegenError(f"non-finite literal {value!r}")
        return repr(float(value))
    if isinstance(value, str) and value in choices and IDENT.fullmatch(value):
        return repr(value)
    raise CodegenError(f"refusing to emit {type(value).__name__} literal {value!r}")


def namespace() -> dict[str, Any]:
    """The closed namespace generated code runs in: torch, the slot namespaces, helpers.

    Safety comes from what the code is made of (registry names and checked literals only),
    not from hiding builtins: torch's C functions import lazily through the caller's
    ``__builtins__``, so a stripped builtins dict breaks them.
    """
    ns: dict[str, Any] = {"torch": lazy_torch.load(),  # torch itself, in the stand-in's place everywhere
                          "ops": ops, "AdvantageBatch": ops.AdvantageBatch,
                          "dataclasses": dataclasses,
                          "fx": masked}  # the masked reductions formulas compile to
    ns.update(registry.namespaces())
    return ns


def load_function(source: str, name: str) -> Callable[..., Any]:
    """Execute generated ``source`` in a closed namespace and return function ``name``.

    The source is registered with linecache under a unique file name so tracebacks show it.
    """
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    filename = f"rldsl-generated-{name}-{digest}.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    ns = namespace()
    code = compile(source, filename, "exec")
    exec(code, ns)  # noqa: S102 - source is generated from registry names and literals only
    return ns[name]
