"""Golden generated code: tests/golden/<algo>.py is the generated source of each library algorithm.

A change to the templates, the code generator or a library spec shows up here as a diff to
review. If the change is intended: ``python tests/regen_golden.py`` and commit the new files.
"""
from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import pytest

import rldsl

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
LIBRARY = sorted(rldsl.library())

_spec = importlib.util.spec_from_file_location("regen_golden", ROOT / "tests" / "regen_golden.py")
assert _spec is not None and _spec.loader is not None
_regen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_regen)
golden_source = _regen.golden_source  # the one definition of what a golden file holds

REGEN = "run `python tests/regen_golden.py` and review `git diff tests/golden`"


def test_one_golden_file_per_library_algorithm() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.py")) == LIBRARY, \
        f"tests/golden/ and algorithms/ list different algorithms: {REGEN}"


@pytest.mark.parametrize("name", LIBRARY)
def test_generated_code_matches_golden(name: str) -> None:
    golden = GOLDEN / f"{name}.py"
    assert golden.is_file(), f"no golden file {golden.relative_to(ROOT)}: {REGEN}"
    want = golden.read_text(encoding="utf-8")
    got = golden_source(name)
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True),
                                            f"tests/golden/{name}.py", f"generated from {name}"))
        pytest.fail(f"the generated code of '{name}' differs from its golden copy.\n"
                    f"If the change is intended, {REGEN}.\n\n{diff}", pytrace=False)


def test_golden_source_is_what_compile_exposes() -> None:
    algo = rldsl.load("grpo")
    fn = rldsl.compile(algo, compile=False)
    assert fn.source == (GOLDEN / "grpo.py").read_text(encoding="utf-8")
    assert fn.source == fn.advantages_source + "\n\n" + fn.loss_source


@pytest.mark.parametrize("name", LIBRARY)
def test_golden_is_valid_python_with_both_functions(name: str) -> None:
    import ast

    tree = ast.parse((GOLDEN / f"{name}.py").read_text(encoding="utf-8"))
    assert [n.name for n in tree.body if isinstance(n, ast.FunctionDef)] == ["advantages", "loss"]
