"""Bad specs as files next to the exact messages they must produce.

Each ``tests/specs/bad/NN_name.rl`` must fail to load with the rendered error in
``NN_name.expected`` (loaded from the repo root, so the path in the message is
``tests/specs/bad/NN_name.rl``). Files without a number are helpers that a case extends.
After an intended change of a message: ``python tests/regen_golden.py --messages``.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import rldsl
from rldsl import SpecError, SpecErrors
from rldsl.errors import source_lines

ROOT = Path(__file__).resolve().parents[2]
BAD = ROOT / "tests" / "specs" / "bad"
CASES = sorted(p for p in BAD.glob("*.rl") if p.name[:2].isdigit())
HELPERS = {"cycle_b.rl", "broken_parent.rl"}  # parents of 34_extends_cycle and 35_parent_has_errors


def _errors(e: SpecError) -> list[SpecError]:
    return e.errors if isinstance(e, SpecErrors) else [e]


def _load_error(rel: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        rldsl.load(rel)
    return info.value


def test_the_bad_specs_folder_is_complete() -> None:
    assert len(CASES) >= 35
    names = {p.name for p in BAD.glob("*.rl")}
    assert names == {p.name for p in CASES} | HELPERS
    expected = {p.stem for p in BAD.glob("*.expected")}
    assert expected == {p.stem for p in CASES}, "every NN_name.rl needs exactly one NN_name.expected"
    assert len({p.name[:2] for p in CASES}) == len(CASES), "case numbers are unique"


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_bad_spec_message(path: Path, in_root: Path) -> None:
    rel = path.relative_to(ROOT).as_posix()
    err = _load_error(rel)
    want = path.with_suffix(".expected").read_text(encoding="utf-8")
    got = err.render() + "\n"
    assert got == want, (
        f"{rel}: the rendered error changed. If the change is intended, run "
        f"`python tests/regen_golden.py --messages` and review `git diff tests/specs`.")
    assert want.startswith(f"{rel}:{err.line}:{err.column}: error: {err.message}\n")
    for e in _errors(err):
        assert e.source is not None, "every error carries its file's text"
        lines = source_lines(e.source)
        if lines:  # a token exists: the position points into the file
            assert 1 <= e.line <= len(lines), (e.line, len(lines))
            assert 1 <= e.column <= len(lines[e.line - 1]) + 1, (e.column, lines[e.line - 1])
            assert e.span.length >= 1
        else:  # an empty file
            assert (e.line, e.column) == (1, 1)


def test_three_independent_errors_are_all_reported(in_root: Path) -> None:
    err = _load_error("tests/specs/bad/58_three_errors.rl")
    assert isinstance(err, SpecErrors)
    assert [(e.line, e.column, e.message) for e in err.errors] == [
        (3, 17, "unknown baseline 'group_mena'"),
        (4, 26, "argument 'low' of trust_region clip must be < 1, got 1.5"),
        (6, 17, "kl k3 needs argument 'beta'"),
    ]
    # the first error is also the SpecError's own location (what an editor jumps to)
    assert (err.line, err.column, err.message) == (3, 17, "unknown baseline 'group_mena'")
    assert err.render().endswith("\n\n3 errors")


def test_independent_errors_from_text_are_all_reported() -> None:
    text = ("algorithm several\n"
            "  baselin       group_mean\n"                 # unknown slot
            "  normalizer    group_std(eps=-1)\n"          # out of range
            "  filter        overlong, overlong\n"         # listed twice
            "  aggregation   token_sum_norm\n")            # missing argument
    with pytest.raises(SpecErrors) as info:
        rldsl.loads(text, filename="several.rl")
    assert [(e.file, e.line, e.column) for e in info.value.errors] == [
        ("several.rl", 2, 3), ("several.rl", 3, 31), ("several.rl", 4, 27), ("several.rl", 5, 17)]


def test_errors_of_a_parent_are_reported_in_the_parent(in_root: Path) -> None:
    err = _load_error("tests/specs/bad/35_parent_has_errors.rl")
    assert [(e.file, e.line, e.column) for e in _errors(err)] == [
        ("tests/specs/bad/35_parent_has_errors.rl", 1, 25),
        ("tests/specs/bad/broken_parent.rl", 3, 17),
        ("tests/specs/bad/broken_parent.rl", 4, 17),
    ]
    parent_error = _errors(err)[1]
    assert parent_error.source == (BAD / "broken_parent.rl").read_text(encoding="utf-8")


def test_a_cycle_is_reported_where_it_closes(in_root: Path) -> None:
    err = _load_error("tests/specs/bad/34_extends_cycle.rl")
    cycle = _errors(err)[-1]
    assert (cycle.file, cycle.line, cycle.column) == ("tests/specs/bad/cycle_b.rl", 2, 27)
    assert cycle.message == "'extends' makes a cycle: cycle_a -> cycle_b -> cycle_a"


def test_a_spec_that_extends_itself_is_a_cycle() -> None:
    with pytest.raises(SpecError) as info:
        rldsl.loads("algorithm selfish extends selfish\n", filename="selfish.rl")
    assert info.value.message == "'extends' makes a cycle: selfish -> selfish"
    assert (info.value.line, info.value.column) == (1, 27)


def test_a_syntax_error_is_a_single_error_not_a_traceback() -> None:
    with pytest.raises(SpecError) as info:
        rldsl.loads("algorithm x\n  trust_region clip(low=0.2\n")
    assert not isinstance(info.value, SpecErrors)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert str(info.value) == info.value.render()


def test_errors_in_crlf_files_render_without_carriage_returns() -> None:
    err = None
    try:
        rldsl.loads("algorithm crlf\r\n  baseline      group_mena\r\n", filename="crlf.rl")
    except SpecError as e:
        err = e
    assert err is not None
    assert err.render() == (
        "crlf.rl:2:17: error: unknown baseline 'group_mena'\n"
        "   2 |   baseline      group_mena\n"
        "     |                 ^~~~~~~~~~\n"
        "     = help: did you mean 'group_mean'?")


def test_the_caret_stays_under_the_token_after_tabs() -> None:
    with pytest.raises(SpecError) as info:
        rldsl.loads("algorithm tabs\n\tbaseline\t\tgroup_mena\n", filename="tabs.rl")
    lines = info.value.render().splitlines()
    assert lines[0] == "tabs.rl:2:12: error: unknown baseline 'group_mena'"
    assert lines[1] == "   2 |  baseline  group_mena"
    assert lines[2] == "     |            ^~~~~~~~~~"
    assert lines[1].index("group_mena") == lines[2].index("^")


def test_a_missing_file_names_the_library_algorithm() -> None:
    with pytest.raises(SpecError) as info:
        rldsl.load("grpoo")
    assert info.value.message == "no such spec file or library algorithm: grpoo"
    assert info.value.hint == "did you mean one of 'grpo', 'gspo', 'rloo'?"


def test_a_comment_before_a_crlf_line_end_does_not_move_the_caret_past_the_line() -> None:
    # COMMENT takes the '\r' of '\r\n': the column must still be just after the visible text
    with pytest.raises(SpecError) as info:
        rldsl.loads("algorithm x\r\n  kl   # which one?\r\n", filename="c.rl")
    assert info.value.render() == (
        "c.rl:2:20: error: unexpected end of line, expected a name\n"
        "   2 |   kl   # which one?\n"
        "     |                    ^\n"
        "     = help: slot 'kl' needs a component, e.g. `kl none`")


def test_a_child_is_reported_before_its_parent_whatever_the_file_names(tmp_path: Path) -> None:
    (tmp_path / "a_parent.rl").write_text("algorithm a_parent\n  kl            k3\n")
    (tmp_path / "z_child.rl").write_text("algorithm z_child extends a_parent\n  baseline      leave_one_ot\n")
    with pytest.raises(SpecErrors) as info:
        rldsl.load(tmp_path / "z_child.rl")
    assert [(Path(e.file).name, e.line, e.column, e.message) for e in info.value.errors] == [
        ("z_child.rl", 1, 27, "parent algorithm 'a_parent' has errors (1, shown below)"),
        ("z_child.rl", 2, 17, "unknown baseline 'leave_one_ot'"),
        ("a_parent.rl", 2, 17, "kl k3 needs argument 'beta'"),
    ]
