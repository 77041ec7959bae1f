"""The one check of a reward value, whatever produced it: a reward function (functions.py), the
``env`` term's episode rewards (a Python environment's ``step``, an agent's return value, a
verifiers or OpenEnv environment: runtime/rollout/), a reward server's answer (remote.py).

A reward is a finite real number: an ``int``, a ``float``, a ``bool`` (1 or 0), a numpy or torch
scalar -- anything ``float()`` reads except text. Text is refused even when it reads as a number
(``"1.0"``): a string is not a score. NaN and inf are refused. ``None`` is no reward; each
caller decides what that means (an environment's step without a reward), so it is refused here.
docs/rewards.md says the same.
"""
from __future__ import annotations

import math

_TEXT = (str, bytes, bytearray)  # float() reads these too ("1.0"): text is not a score


def reward_value(value: object, source: str) -> float:
    """``value`` as a float, or a ``ValueError`` naming ``source`` (what produced it, as the subject
    of "returned": ``"the agent"``, ``"environment Env.step"``) and the value."""
    if isinstance(value, _TEXT):
        raise ValueError(f"{source} returned {value!r:.100} (a {type(value).__name__}), not a number: "
                         "text is not a score")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
        raise ValueError(f"{source} returned {value!r:.100} (a {type(value).__name__}), not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"{source} returned a non-finite value {number}")
    return number


def finite_or_error(value: object, source: str) -> float | BaseException:
    """``value`` as a finite float (:func:`reward_value`), or the ValueError saying it is not one:
    returned, not raised, for a batch, where each sample's failure is its own (``RewardTerm``
    raises it for a single call)."""
    try:
        return reward_value(value, source)
    except ValueError as e:
        return e
