"""``sampling replay(...)``'s policy as the runtime reads it, and its priority formula.

A replay buffer ranks the groups it holds by a priority written in the spec:
``priority="std * sum(abs(adv))"``. The text is a formula of the language (rldsl/formula/:
the same grammar, checks, error messages and function table as a slot's formula), read on the
rows of one prompt group (``lang.ARGUMENTS["priority"]``; its inputs are the inputs table's,
rldsl/inputs.py): ``r`` the group's scorable rewards [B], ``adv`` = r - mean [B], ``mean``,
``std`` (unbiased; 0 below two), ``n`` []; ``sum mean std max min (x)`` reduce the group's rows.
A formula whose value is [B] (``abs(adv) * std``) has the wrong shape: a priority is one number
per group.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .formula import argument
from .lazy_torch import torch

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class GroupFormula:
    """A checked priority formula, held by its text (a policy pickles as plain data, to Ray actors
    and FSDP ranks); the function it compiles to is built once per process (:func:`_compiled`)."""

    text: str

    def __call__(self, rewards: Tensor) -> float:
        """The priority of one group from its rewards [G] (NaN = failed, left out)."""
        r = rewards.to(torch.float64)
        r = r[~torch.isnan(r)]
        mean = r.mean() if r.numel() else torch.tensor(float("nan"), dtype=torch.float64)
        std = r.std() if r.numel() >= 2 else torch.tensor(0.0, dtype=torch.float64)
        n = torch.tensor(float(r.numel()), dtype=torch.float64)
        return float(_compiled(self.text)(r=r, adv=r - mean, mean=mean, std=std, n=n))


@functools.lru_cache(maxsize=64)
def _compiled(text: str) -> Callable[..., Any]:
    return argument.function(argument.formula("priority", text))


def parse(text: str) -> GroupFormula:
    """A priority formula checked and compiled; a ValueError names its first error (a spec
    reports it at its file:line:col: spec.py)."""
    _compiled(text)
    return GroupFormula(text)


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

    def mixed(self, P: int) -> int:
        """``use=mix``: how many of a step's P groups the policy takes from the buffer, round(mix x P)
        at most ``per_step`` (0 with ``use=substitute``); the buffer may hold fewer (rollout/replay.py)."""
        if self.use != "mix":
            return 0
        k = int(round(self.mix * P))
        return min(k, self.per_step) if self.per_step else k

    def describe(self) -> str:
        """One line for ``rldsl explain`` and the run's start."""
        prio = self.priority if isinstance(self.priority, str) else f'"{self.priority.text}"'
        use = f"mix {self.mix:g} of each step's groups" if self.use == "mix" else "substitute non-informative groups"
        return (f"replay: buffer of {self.capacity} groups, enter {self.enter}, priority {prio}, {use}"
                + (f", at most {self.per_step} per step" if self.per_step else "")
                + (f", dropped after {self.max_age} versions" if self.max_age is not None else "")
                + (", advantage kept" if self.advantage == "keep" else ""))
