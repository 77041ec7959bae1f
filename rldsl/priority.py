"""Group formulas: ``sampling replay(priority="std * sum(abs(adv))")``, a number per prompt group.

A replay buffer ranks the groups it holds by a priority written in the spec. The formula reads
one group's rewards and gives one number for it; this module checks it (names, functions,
shape) when the spec is read, and evaluates it when a group enters the buffer.

Names: ``r`` the group's scorable rewards [G], ``adv`` = r - mean [G], ``mean``, ``std`` (the
unbiased standard deviation, as torch.std), ``n`` (the number of scorable rewards): scalars.
Functions: ``sum``, ``mean``, ``max``, ``min`` ([G] -> scalar); ``abs``, ``sqrt``, ``exp``,
``log`` (elementwise). Operators ``+ - * /`` and unary minus; numbers. A formula whose value is
[G] (``abs(adv) * std``) has the wrong shape: a priority is one number per group.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .lazy_torch import torch

if TYPE_CHECKING:
    from torch import Tensor

PER_SAMPLE = {"r": "the group's rewards", "adv": "r - mean"}
PER_GROUP = {"mean": "the mean reward", "std": "the unbiased standard deviation", "n": "the number of rewards"}
# names of torch functions (torch is imported at the first evaluation: rldsl/lazy_torch.py)
REDUCE = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin"}
ELEMENTWISE = {"abs": "abs", "sqrt": "sqrt", "exp": "exp", "log": "log"}
_OPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div"}


def FormulaError(message: str, column: int = 0, length: int = 1, hint: str | None = None) -> ValueError:
    """A priority formula that cannot be read: ``ValueError(message, column, length, hint)``, the
    column 0-based in the formula's text (the spec reports it at its file:line:col, spec.py)."""
    return ValueError(message, column, length, hint)


@dataclass(frozen=True)
class GroupFormula:
    """A checked group formula: its text and its syntax tree."""

    text: str
    tree: ast.expr

    def __call__(self, rewards: Tensor) -> float:
        """The priority of one group from its rewards [G] (NaN = failed, left out)."""
        r = rewards.to(torch.float64)
        r = r[~torch.isnan(r)]
        mean = r.mean() if r.numel() else torch.tensor(float("nan"), dtype=torch.float64)
        std = r.std() if r.numel() >= 2 else torch.tensor(0.0, dtype=torch.float64)
        env = {"r": r, "adv": r - mean, "mean": mean, "std": std,
               "n": torch.tensor(float(r.numel()), dtype=torch.float64)}
        return float(_eval(self.tree, env))


def parse(text: str) -> GroupFormula:
    """Check a priority formula; a ValueError (:func:`FormulaError`) says what is wrong and where."""
    lead = len(text) - len(text.lstrip())  # columns count from the text as written
    try:
        return _parse(text)
    except ValueError as e:
        if len(e.args) != 4:
            raise
        message, column, length, hint = e.args
        raise FormulaError(message, column + lead, length, hint) from None


def _parse(text: str) -> GroupFormula:
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise FormulaError(f"cannot read the priority formula: {e.msg}", max(0, (e.offset or 1) - 1),
                           hint="e.g. priority=\"std * sum(abs(adv))\"") from None
    if _shape(tree) != "1":
        raise FormulaError("a priority is one number per group, but this formula gives one per sample [G]",
                           0, len(text.strip()),
                           hint="reduce it over the group: sum(...), mean(...), max(...) or min(...)")
    return GroupFormula(text, tree)


def _shape(node: ast.AST) -> str:
    """'G' (one value per sample) or '1' (one per group) of a node; raises on what is not allowed."""
    at = dict(column=getattr(node, "col_offset", 0),
              length=max(1, getattr(node, "end_col_offset", 1) - getattr(node, "col_offset", 0)))
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        if not math.isfinite(node.value):
            raise FormulaError("a number in a priority formula must be finite", **at)
        return "1"
    if isinstance(node, ast.Name):
        if node.id in PER_SAMPLE:
            return "G"
        if node.id in PER_GROUP:
            return "1"
        raise FormulaError(f"unknown name {node.id!r} in a priority formula", **at,
                           hint="names: " + ", ".join([*PER_SAMPLE, *PER_GROUP]))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return "G" if "G" in (_shape(node.left), _shape(node.right)) else "1"
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _shape(node.operand)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id
        if name not in REDUCE and name not in ELEMENTWISE:
            raise FormulaError(f"unknown function {name!r} in a priority formula", **at,
                               hint="functions: " + ", ".join([*REDUCE, *ELEMENTWISE]))
        if len(node.args) != 1 or node.keywords:
            raise FormulaError(f"{name}() takes one argument", **at)
        inner = _shape(node.args[0])
        if name in REDUCE:
            if inner != "G":
                raise FormulaError(f"{name}() reduces a per-sample value over the group; its argument "
                                   "is already one number per group", **at)
            return "1"
        return inner
    raise FormulaError("a priority formula holds numbers, names, + - * /, and function calls only", **at)


def _eval(node: ast.AST, env: dict[str, Tensor]) -> Tensor:
    if isinstance(node, ast.Constant):
        return torch.tensor(float(node.value), dtype=torch.float64)
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.BinOp):
        return getattr(torch, _OPS[type(node.op)])(_eval(node.left, env), _eval(node.right, env))
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, env)
        return -v if isinstance(node.op, ast.USub) else v
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    fn = REDUCE.get(node.func.id) or ELEMENTWISE[node.func.id]
    return getattr(torch, fn)(_eval(node.args[0], env))


@dataclass(frozen=True)
class ReplayPolicy:
    """``sampling replay(...)``'s parameters as the runtime reads them (``CompiledAlgorithm.data.replay``);
    ``priority`` is ``"uniform"``, ``"newest"`` or a checked :class:`GroupFormula`."""

    capacity: int
    enter: str
    priority: "str | GroupFormula"
    use: str
    mix: float
    per_step: int | None
    max_age: int | None
    advantage: str = "recompute"  # or "keep": the advantage of the group's first training (rollout/replay.py)

    @staticmethod
    def of(params: dict) -> "ReplayPolicy":
        p = params["priority"]
        return ReplayPolicy(params["capacity"], params["enter"], p if p in ("uniform", "newest") else parse(p),
                            params["use"], params["mix"], params.get("per_step"), params.get("max_age"),
                            params.get("advantage", "recompute"))

    def describe(self) -> str:
        """One line for ``rldsl explain`` and the run's start."""
        prio = self.priority if isinstance(self.priority, str) else f'"{self.priority.text}"'
        use = f"mix {self.mix:g} of each step's groups" if self.use == "mix" else "substitute non-informative groups"
        return (f"replay: buffer of {self.capacity} groups, enter {self.enter}, priority {prio}, {use}"
                + (f", at most {self.per_step} per step" if self.per_step else "")
                + (f", dropped after {self.max_age} versions" if self.max_age is not None else "")
                + (", advantage kept" if self.advantage == "keep" else ""))
