"""docs/errors.md lists every error a user can see with its exit code, and every error class lives in
one of the two homes (rldsl/errors.py, runtime/errors.py)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import rldsl.errors
import rldsl.runtime.errors
from rldsl.errors import EXIT_BAD_INPUT, UserError

REPO = Path(__file__).resolve().parent.parent
DOC = (REPO / "docs" / "errors.md").read_text(encoding="utf-8")
HOMES = {REPO / "rldsl" / "errors.py", REPO / "runtime" / "errors.py"}
#: not a user error: a value that must never reach generated code did (a bug in rldsl, exit 1)
BUGS = {"CodegenError"}


def _user_errors() -> list[type]:
    found, todo = [], [UserError]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__ in ("rldsl.errors", "rldsl.runtime.errors"):
                found.append(sub)
                todo.append(sub)
    return sorted(set(found), key=lambda c: c.__name__)


def _doc_rows() -> dict[str, str]:
    """class name -> its exit code cell, from the table of docs/errors.md."""
    rows = {}
    for line in DOC.splitlines():
        m = re.match(r"\| `(\w+)` \| ([^|]+) \|", line)
        if m:
            rows[m.group(1)] = m.group(2).strip()
    return rows


def test_every_error_class_is_documented_with_its_exit_code() -> None:
    classes = _user_errors()
    assert len(classes) >= 17  # the language's 7 and the runtime's 10
    rows = _doc_rows()
    for cls in classes:
        assert cls.__name__ in rows, f"{cls.__name__} is not in docs/errors.md"
        assert rows[cls.__name__].startswith(str(cls.exit_code)), (cls.__name__, rows[cls.__name__])
    assert set(rows) == {c.__name__ for c in classes}, "docs/errors.md lists a class that does not exist"
    for cls in classes:
        assert cls.exit_code in (1, 2, 130) and isinstance(cls.exit_code, int)
    assert rldsl.runtime.errors.ConfigError.exit_code == EXIT_BAD_INPUT


def test_error_classes_live_in_their_two_homes() -> None:
    """No module of the language or the runtime defines an exception class outside rldsl/errors.py
    and runtime/errors.py (CodegenError, a bug class, excepted)."""
    elsewhere = []
    for folder in (REPO / "rldsl", REPO / "runtime"):
        for path in sorted(folder.rglob("*.py")):
            if path in HOMES:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and node.name not in BUGS and any(
                        re.search(r"(Error|Exception|Timeout|Interrupt)$", ast.unparse(b)) for b in node.bases):
                    elsewhere.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert not elsewhere, elsewhere


def test_the_exit_code_table_is_the_code() -> None:
    for code, word in ((0, "ok"), (1, "failed"), (2, "bad input"), (130, "interrupted")):
        assert re.search(rf"^\| {code} \| [^\n]*{word}", DOC, re.M), code
    assert (rldsl.errors.EXIT_OK, rldsl.errors.EXIT_FAILED, rldsl.errors.EXIT_BAD_INPUT,
            rldsl.errors.EXIT_INTERRUPTED) == (0, 1, 2, 130)
