"""Config files: the one reader (JSON, YAML, TOML -> a dict) and the one TOML writer; the
one UTF-8 decoding of a file's bytes that names the file, line and column of a bad byte.

The run config (``rldsl run --config``), ``rldsl translate``'s peer configs and run.toml,
and ``rldsl ablate``'s grid.toml all go through these two functions, so that a file one
command writes is a file another reads.
"""
from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any, Mapping

from .errors import UserError

__all__ = ["read_config_file", "decode_utf8", "too_deep", "toml_value", "to_toml"]

#: suffix -> format; anything else is read as ``default`` (read_config_file's argument)
_FORMATS = {".json": "json", ".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}


def read_config_file(path: str | Path, *, error: type[UserError], default: str = "toml",
                     what: str = "config file") -> dict[str, Any]:
    """The mapping a .json, .yaml/.yml or .toml file holds (other suffixes: ``default``).

    Every problem (no file, unreadable, invalid syntax with its line, not a mapping) raises
    ``error`` with a message naming the file, so each caller keeps its own error class.
    """
    p = Path(path)
    try:
        text = decode_utf8(p.read_bytes(), p, error)
    except FileNotFoundError:
        raise error(f"{what} not found: {p}") from None
    except OSError as exc:
        raise error(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    fmt = _FORMATS.get(p.suffix.lower(), default)
    try:
        if fmt == "json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise error(f"{p}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
        elif fmt == "yaml":
            import yaml
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise error(f"{p}: invalid YAML: {exc}") from None
        else:
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise error(f"{p}: invalid TOML: {exc}") from None
    except RecursionError:
        raise error(too_deep(p)) from None
    if not isinstance(data, dict):
        raise error(f"{p}: expected a mapping of keys, got {type(data).__name__}")
    return data


def decode_utf8(raw: bytes, path: str | Path, error: type[UserError], first_line: int = 1) -> str:
    """The text of a file's bytes (or of its lines from ``first_line`` on), or ``error`` naming
    ``path:line:col`` of the first byte that is not UTF-8 (a Latin-1 or UTF-16 file): every file
    rldsl reads is UTF-8, and Python's own ``UnicodeDecodeError`` names neither file nor line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + first_line
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise error(f"{path}:{line}:{column}: not UTF-8 text (byte 0x{raw[exc.start]:02x}): save the file "
                    "as UTF-8") from None


def too_deep(path: str | Path, line: int | None = None) -> str:
    """The message for a file whose lists or tables nest deeper than a parser's recursion goes
    (JSON, TOML, YAML ~1,000 levels): no config or data row nests so deep."""
    where = f"{path}:{line}" if line is not None else f"{path}"
    return f"{where}: lists or tables nested too deeply to read (over ~1,000 levels)"


def toml_value(value: Any) -> str:
    """One TOML value: a bool, number, string, list (inline when it fits in 80 characters,
    else one item per line) or inline table. Refuses None and non-finite floats, which TOML
    cannot hold."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"TOML has no value for {value!r}")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        items = [toml_value(v) for v in value]
        inline = "[" + ", ".join(items) + "]"
        if len(inline) <= 80:
            return inline
        return "[\n" + "".join(f"  {item},\n" for item in items) + "]"
    raise ValueError(f"TOML has no value for {value!r} ({type(value).__name__})")


def _key(key: str) -> str:
    bare = key.replace("_", "").replace("-", "").isalnum() and key.isascii()
    return key if bare else json.dumps(key)


def to_toml(keys: Mapping[str, Any], header: str = "") -> str:
    """A TOML document of dotted keys: ``{"seed": 1, "train.lr": 1e-6}`` -> top-level keys
    first, then one ``[section]`` table per prefix in the order first seen. ``header``: comment
    lines put first (each gets its ``# ``). Keys whose value is None are left out (TOML has no
    null: the field keeps its default)."""
    sections: dict[str, list[str]] = {"": []}
    for dotted, value in keys.items():
        if value is None:
            continue
        section, _, leaf = dotted.rpartition(".")
        sections.setdefault(section, []).append(f"{_key(leaf)} = {toml_value(value)}")
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for section, items in sections.items():
        if not items:
            continue
        lines += ([f"[{section}]"] if section else []) + items  # no blank lines: one block
    return "\n".join(lines) + "\n"
