"""The grammar's tables kept in the user's cache (rldsl/parse_tables.py): the cached parser is the
built one (same trees, same positions, same errors), a file is read only when it is this user's
and private, and anything damaged or foreign is rebuilt, never trusted."""
from __future__ import annotations

import os
import stat

import pytest
from lark import Lark

from rldsl import parse_tables, parser
from rldsl.cache import CACHE_ENV
from rldsl.errors import SpecError
from rldsl.spec import library


def _built() -> Lark:
    return Lark(parser.grammar_text(), **parser._OPTIONS)


def _never() -> Lark:
    raise AssertionError("the tables were built again: the cache was not used")


def _tokens(tree) -> list[tuple]:
    return [(t.type, str(t), t.line, t.column, t.end_line, t.end_column, t.start_pos)
            for t in tree.scan_values(lambda v: True)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(d))
    return d


def test_the_json_tables_parse_every_library_spec_as_the_built_parser_does():
    built = _built()
    loaded = parse_tables.from_json(parse_tables.to_json(built))
    for name, path in library().items():
        src = path.read_text(encoding="utf-8")
        a, b = built.parse(src), loaded.parse(src)
        assert a == b, name
        assert _tokens(a) == _tokens(b), name
    for bad in ("algorithm x\n  baseline = (\n", "algorithm 1\n", "algorithm x extends\n"):
        errors = []
        for p in (built, loaded):
            with pytest.raises(Exception) as e:
                p.parse(bad)
            errors.append((type(e.value).__name__, getattr(e.value, "line", None), getattr(e.value, "column", None),
                           sorted(getattr(e.value, "expected", None) or getattr(e.value, "allowed", None) or [])))
        assert errors[0] == errors[1], bad


def test_the_first_process_builds_and_keeps_the_tables_the_next_reads_them(cache):
    first = parse_tables.load_parser(parser.grammar_text(), _built, parser._OPTIONS)
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].name.startswith("grammar-") and files[0].suffix == ".json"
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    again = parse_tables.load_parser(parser.grammar_text(), _never, parser._OPTIONS)
    src = library()["dapo"].read_text(encoding="utf-8")
    assert _tokens(again.parse(src)) == _tokens(first.parse(src))


def test_another_grammar_or_other_options_never_read_the_kept_tables(cache):
    parse_tables.load_parser(parser.grammar_text(), _built, parser._OPTIONS)
    other = dict(parser._OPTIONS, propagate_positions=False)
    assert parse_tables.cache_file(parser.grammar_text(), other) != \
        parse_tables.cache_file(parser.grammar_text(), parser._OPTIONS)
    assert parse_tables.cache_file(parser.grammar_text() + "\n// edited\n", parser._OPTIONS) != \
        parse_tables.cache_file(parser.grammar_text(), parser._OPTIONS)
    built = []
    parse_tables.load_parser(parser.grammar_text(), lambda: built.append(1) or _built(), other)
    assert built == [1]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "writable by others", "a link"])
def test_a_damaged_or_foreign_file_is_rebuilt_and_replaced(cache, damage, tmp_path):
    parse_tables.load_parser(parser.grammar_text(), _built, parser._OPTIONS)
    (path,) = cache.iterdir()
    good = path.read_text()
    if damage == "garbage":
        path.write_text('{"data": {"__class__": "os.system"}}')
    elif damage == "truncated":
        path.write_text(good[: len(good) // 2])
    elif damage == "writable by others":
        path.chmod(0o666)
    else:
        target = tmp_path / "elsewhere.json"
        target.write_text(good)
        path.unlink()
        path.symlink_to(target)
    damaged = path.read_text()
    built = []
    p = parse_tables.load_parser(parser.grammar_text(), lambda: built.append(1) or _built(), parser._OPTIONS)
    assert built == [1]
    assert p.parse("algorithm x\n").data
    assert not path.is_symlink() and path.is_file()  # replaced: a link is never written through
    if damage == "a link":
        assert target.read_text() == damaged
    assert _tokens(parse_tables.from_json(path.read_text()).parse("algorithm x\n")) == _tokens(p.parse("algorithm x\n"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_folder_others_may_write_is_neither_read_nor_written(cache):
    parse_tables.load_parser(parser.grammar_text(), _built, parser._OPTIONS)
    cache.chmod(0o777)
    built = []
    parse_tables.load_parser(parser.grammar_text(), lambda: built.append(1) or _built(), parser._OPTIONS)
    assert built == [1]


def test_where_nothing_can_be_written_the_tables_are_built_each_time(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    for _ in range(2):
        built = []
        p = parse_tables.load_parser(parser.grammar_text(), lambda: built.append(1) or _built(), parser._OPTIONS)
        assert built == [1] and p.parse("algorithm x\n").data
    assert not os.path.exists(blocker / "cache")


def test_parse_errors_read_the_same_through_the_kept_tables(cache, monkeypatch):
    """The user's message (file:line:col, what was expected) is the same from cached tables."""
    bad = "algorithm x\n  baseline = group_mean(\n"
    messages = []
    monkeypatch.setattr(parser, "_parser", parser._parser.__wrapped__)  # the cache, at each parse
    for _ in range(2):  # built, then read back
        with pytest.raises(SpecError) as e:
            parser.parse(bad, "bad.rl")
        messages.append(str(e.value))
    assert len(list(cache.iterdir())) == 1
    assert messages[0] == messages[1]


def test_a_text_parsed_again_is_not_parsed_again_and_each_caller_owns_its_lists(monkeypatch):
    src = library()["grpo"].read_text(encoding="utf-8")
    first = parser.parse(src, "grpo.rl")
    monkeypatch.setattr(parser, "_parser", _never)  # a second parse of the same text reads the memo
    second = parser.parse(src, "grpo.rl")
    assert second == first and second is not first
    second.slots.clear()
    second.descriptions.append(first.name)
    assert parser.parse(src, "grpo.rl") == first
