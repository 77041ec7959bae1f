"""The resolved values of a spec's slots: :class:`Origin` (where a value was written) and
:class:`SlotValue` (one component filling a slot, every parameter known).

These data types sit low in the language core, below the spec checker, the formula hooks
and the code generator, which all build or read them.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from . import registry
from .errors import Span
from .formula import component as formula_component
from .registry import format_value

ParamValue = float | int | bool | str | None


class Origin(BaseModel):
    """Where a slot's value was written (None on a SlotValue = the slot default)."""

    model_config = ConfigDict(frozen=True)
    algorithm: str
    file: str
    line: int
    column: int

    @classmethod
    def at(cls, algorithm: str, span: Span) -> "Origin":
        """The origin of what ``algorithm`` writes at ``span``."""
        return cls(algorithm=algorithm, file=span.file, line=span.line, column=span.column)


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
        """Its registry entry (parameters, formula, facts). A formula written in the spec has
        none: it answers with an entry derived from its checked tree (formula/component.py)."""
        if self.formula is not None:
            return formula_component.component(self.formula).given(self.params)
        return registry.get(self.slot, self.component).given(self.params)

    @property
    def stage(self) -> str:
        """Where it acts with its parameters (kl ``where=reward`` moves it to the advantage)."""
        return self.spec.stage(self.params)

    def __str__(self) -> str:
        """``component(k=v, ...)``: every parameter with a value that the component reads with
        these values (one it ignores, e.g. ``clip_low`` with ``mode=supervised``, left out)."""
        params = self.spec.params
        given = {k: v for k, v in self.params.items()
                 if v is not None and (k not in params or params[k].used(self.params))}
        if not given:
            return self.component
        return f"{self.component}(" + ", ".join(f"{k}={_spec_value(params.get(k), v)}" for k, v in given.items()) + ")"


def _spec_value(p: Any, v: Any) -> str:
    """A value as a spec writes it: a group formula (a ``formula`` parameter's text) in quotes."""
    if p is not None and p.kind == "formula" and v not in p.choices:
        return f'"{v}"'
    return format_value(v)
