"""The spec grammar's LALR tables, built once per installation and kept in the user's cache.

Building the tables from ``grammar/rl.lark`` takes a tenth of a second or more, most of what
``rldsl check`` costs after Python's own start. The built parser is saved as plain JSON (never a
pickle: a cache file can hold no code), named by a hash of the grammar text, Lark's version and
the parser options, so an edited grammar or another Lark never reads a stale table.

The folder is the user's rldsl cache (rldsl/cache.py: ``$RLDSL_CACHE``, else
``$XDG_CACHE_HOME/rldsl``, else ``~/.cache/rldsl``). A file is read only when it and its folder
belong to this user and nobody else may write them; a file that cannot be read, or does not
load, is rebuilt and replaced (written to a temporary name, then renamed, so a concurrent reader
sees the old file or the new one). Where nothing can be written (a read-only home), the tables
are built in each process, as before.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable

import lark
from lark import Lark
from lark.grammar import Rule
from lark.lexer import TerminalDef

from .cache import cache_dir

# JSON has no tuples and no integer keys; the tables have both. Tagged, they come back the same.
_DICT, _TUPLE = "\x00dict", "\x00tuple"


def _encode(x: Any) -> Any:
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: _encode(v) for k, v in x.items()}
        return {_DICT: [[_encode(k), _encode(v)] for k, v in x.items()]}
    if isinstance(x, tuple):
        return {_TUPLE: [_encode(v) for v in x]}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    raise TypeError(f"the grammar tables hold a {type(x).__name__}: not kept as JSON")


def _decode(x: Any) -> Any:
    if isinstance(x, dict):
        if _DICT in x:
            return {_decode(k): _decode(v) for k, v in x[_DICT]}
        if _TUPLE in x:
            return tuple(_decode(v) for v in x[_TUPLE])
        return {k: _decode(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_decode(v) for v in x]
    return x


def to_json(parser: Lark) -> str:
    data, memo = parser.memo_serialize([TerminalDef, Rule])
    return json.dumps(_encode({"data": data, "memo": memo}))


def from_json(text: str) -> Lark:
    return Lark.load(_decode(json.loads(text)))


def _private(st: os.stat_result) -> bool:
    """Owned by this user, writable by nobody else."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def cache_file(grammar: str, options: dict[str, Any]) -> Path:
    key = json.dumps([grammar, lark.__version__, sorted(options.items())])
    return cache_dir() / f"grammar-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _read(path: Path) -> Lark | None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, encoding="utf-8") as f:
            if not (_private(os.fstat(f.fileno())) and _private(os.stat(path.parent))):
                return None
            return from_json(f.read())
    except Exception:  # noqa: BLE001 - a damaged or foreign file is rebuilt, never trusted
        return None


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(os.stat(path.parent)):
            return
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".grammar-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return  # nothing can be written here: the next process builds the tables again


def load_parser(grammar: str, build: Callable[[], Lark], options: dict[str, Any]) -> Lark:
    """The parser of ``grammar`` with ``options`` from the cache, else ``build()`` (and kept)."""
    path = cache_file(grammar, options)
    parser = _read(path)
    if parser is not None:
        return parser
    parser = build()
    try:
        text = to_json(parser)
    except TypeError:  # pragma: no cover - a Lark whose tables JSON cannot hold
        return parser
    _write(path, text)
    return parser
