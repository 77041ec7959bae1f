"""Shared fixtures of the language tests (parser, checker, code generator)."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_root(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run the test from the repo root, so spec paths (and the messages naming them) are relative."""
    monkeypatch.chdir(ROOT)
    return ROOT
