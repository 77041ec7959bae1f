"""Did-you-mean suggestions: the one place a misspelt name is matched against the valid ones.

Used by the spec errors (spec.py, formula/check.py, formula/hooks.py, translate.py) and the
runtime's config keys (runtime/config.py). Imports nothing of the package, so any module may use it.
"""
from __future__ import annotations

import difflib
from typing import Iterable, Sequence

#: How alike a name must be to be offered (difflib's ratio, as click uses).
CUTOFF = 0.6


def close_matches(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The (at most ``n``) valid names closest to ``word``, best first; ties in name order."""
    return difflib.get_close_matches(word, sorted(set(choices)), n=n, cutoff=CUTOFF)


def suggestion(close: Sequence[str]) -> str | None:
    """``"did you mean 'x'?"`` / ``"did you mean one of 'x', 'y'?"`` for the names found, or None."""
    if not close:
        return None
    if len(close) == 1:
        return f"did you mean {close[0]!r}?"
    return "did you mean one of " + ", ".join(repr(c) for c in close) + "?"


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """The suggestion for ``word`` among ``choices`` (the close names in name order), or None."""
    return suggestion(sorted(close_matches(word, choices)))
