"""``torch``, imported at the first tensor operation rather than when a module is imported.

The language's commands (``rldsl list``, ``check``, ``explain``, ``translate``) read the
registry's names, parameters, docstrings and facts, never a tensor, so the modules they import
(the components, ``ops``, the masked reductions) must not import torch (2-3 s). Those
modules write ``from ..lazy_torch import torch`` and use ``torch`` only inside function bodies;
their annotations are strings (``from __future__ import annotations``, ``Tensor`` imported
under ``TYPE_CHECKING``).

Until torch is needed, ``torch`` here is a stand-in module whose first attribute access
imports torch (:func:`load`). ``load`` then puts torch itself in place of the stand-in in
every rldsl module that bound it, so later lookups, and torch.compile tracing a component,
find the real module. ``rldsl.compile`` and the generated code's namespace call ``load``
before anything is traced; when torch is already imported, the stand-in is never made.
"""
from __future__ import annotations

import sys
import types
from typing import Any


class _LazyTorch(types.ModuleType):
    """Stands for torch until an attribute is read; then torch is imported (see :func:`load`)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(load(), name)


def load() -> types.ModuleType:
    """Import torch and bind it, in place of the stand-in, in every rldsl module that holds it."""
    import torch as real

    global torch
    stand_in, torch = torch, real
    if stand_in is not real:
        for name, module in list(sys.modules.items()):
            if (name == "rldsl" or name.startswith("rldsl.")) and getattr(module, "__dict__", {}).get("torch") is stand_in:
                module.__dict__["torch"] = real
    return real


torch: types.ModuleType = sys.modules.get("torch") or _LazyTorch("torch")
