"""Malformed formulas as files next to the exact messages they must produce.

Each ``tests/specs/bad_formula/NN_name.rl`` (a ``define`` block gone wrong: syntax, names,
arity, kinds, shapes, constants, padding, slot rules) must fail to load with the rendered
error in ``NN_name.expected``, loaded from the repo root. After an intended change of a
message: ``python tests/regen_golden.py --messages``.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import rldsl
from rldsl import SpecError, SpecErrors, codegen
from rldsl.errors import source_lines

ROOT = Path(__file__).resolve().parents[2]
BAD = ROOT / "tests" / "specs" / "bad_formula"
CASES = sorted(p for p in BAD.glob("*.rl") if p.name[:2].isdigit())


def test_the_bad_formulas_folder_is_complete() -> None:
    assert len(CASES) >= 30
    assert {p.stem for p in BAD.glob("*.expected")} == {p.stem for p in CASES}, \
        "every NN_name.rl needs exactly one NN_name.expected"
    assert len({p.name[:2] for p in CASES}) == len(CASES), "case numbers are unique"


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_bad_formula_message(path: Path, in_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_codegen(*a: object, **k: object) -> None:
        raise AssertionError("code was generated for a rejected spec")

    monkeypatch.setattr(codegen, "generate", no_codegen)
    rel = path.relative_to(ROOT).as_posix()
    with pytest.raises(SpecError) as info:
        rldsl.compile(rldsl.load(rel), compile=False)
    err = info.value
    want = path.with_suffix(".expected").read_text(encoding="utf-8")
    assert err.render() + "\n" == want, (
        f"{rel}: the rendered error changed. If the change is intended, run "
        f"`python tests/regen_golden.py --messages` and review `git diff tests/specs`.")
    assert want.startswith(f"{rel}:{err.line}:{err.column}: error: {err.message}\n")
    lines = source_lines(err.source or "")
    for e in err.errors if isinstance(err, SpecErrors) else [err]:
        assert 1 <= e.line <= len(lines) and 1 <= e.column <= len(lines[e.line - 1]) + 1
        assert "^" in e.render(), "every error has a caret under the offending text"


def test_a_define_used_in_two_slots_reports_its_problems_once() -> None:
    text = ("algorithm twice\n"
            "  define shared\n"
            "    w = rho / 0\n"
            "    l = -A * w\n"
            "  end\n"
            "  trust_region  shared\n"
            "  objective     shared\n")
    with pytest.raises(SpecError) as info:
        rldsl.loads(text, filename="twice.rl")
    errs = info.value.errors if isinstance(info.value, SpecErrors) else [info.value]
    zero = [e for e in errs if e.message == "division by zero"]
    assert len(zero) == 1 and (zero[0].line, zero[0].column) == (3, 15)


def test_every_error_of_a_define_is_reported() -> None:
    text = ("algorithm several\n"
            "  define gate\n"
            "    a = sigmod(rho)\n"      # unknown function
            "    b = rh0 + 1\n"          # unknown name
            "    w = a * b / 0\n"        # division by zero
            "  end\n"
            "  trust_region  gate\n")
    with pytest.raises(SpecErrors) as info:
        rldsl.loads(text, filename="several.rl")
    assert [(e.line, e.column, e.message) for e in info.value.errors] == [
        (3, 9, "unknown function 'sigmod'"), (4, 9, "unknown name 'rh0'"), (5, 17, "division by zero")]
