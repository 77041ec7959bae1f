"""Text -> syntax tree of a spec, with Lark's errors translated into the user's words.

The grammar (``grammar/rl.lark``, shipped as package data) is loaded once, LALR with
propagated positions; its tables are built once per installation (``rldsl.parse_tables``). The
result is a :class:`SpecFile`: plain nodes that remember where each name and value stands, so
that every later check can point at the source.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

import lark
from lark import Lark, Token, Transformer
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from . import registry
from .errors import Span, SpecError, source_lines
from .formula import syntax as formula_syntax
from .formula.nodes import Define, FunctionDef
from .parse_tables import load_parser

# ---------------------------------------------------------------------------------------
# Syntax nodes


@dataclass(frozen=True)
class Word:
    """A name or literal in the source, with its place."""

    text: str
    span: Span


@dataclass(frozen=True)
class ArgNode:
    name: Word
    kind: str  # "number" | "word" | "string"
    value: Word


@dataclass(frozen=True)
class ComponentNode:
    name: Word
    args: tuple[ArgNode, ...]
    has_parens: bool


@dataclass(frozen=True)
class SlotNode:
    name: Word
    components: tuple[ComponentNode, ...]


@dataclass
class SpecFile:
    """A parsed ``.rl`` file."""

    file: str
    source: str
    name: Word
    extends: Word | None
    descriptions: list[Word] = field(default_factory=list)
    slots: list[SlotNode] = field(default_factory=list)
    defines: list[Define] = field(default_factory=list)  # formula components (rldsl.formula)
    functions: list[FunctionDef] = field(default_factory=list)  # `define f(x) = ...` (rldsl.formula)


# ---------------------------------------------------------------------------------------
# Grammar


@functools.lru_cache(maxsize=1)
def grammar_text() -> str:
    return resources.files("rldsl._grammar").joinpath("rl.lark").read_text(encoding="utf-8")


#: how the grammar is built (part of the cached tables' name: rldsl.parse_tables)
_OPTIONS = {"parser": "lalr", "propagate_positions": True, "maybe_placeholders": False}


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    return load_parser(grammar_text(), lambda: Lark(grammar_text(), **_OPTIONS), _OPTIONS)


# Lark's terminal names as the user reads them.
_TERMINALS = {
    "$END": "end of file", "_NL": "end of line", "NAME": "a name", "SIGNED_NUMBER": "a number",
    "STRING": "a string", "LPAR": "'('", "RPAR": "')'", "COMMA": "','", "EQUAL": "'='",
    "ALGORITHM": "'algorithm'", "EXTENDS": "'extends'", **formula_syntax.TERMINAL_WORDS,
}


def _describe(term: str) -> str:
    if term in _TERMINALS:
        return _TERMINALS[term]
    try:
        pattern = _parser().get_terminal(term).pattern
        if isinstance(pattern, lark.lexer.PatternStr):
            return repr(pattern.value)
    except (KeyError, AttributeError):
        pass
    return term.lower()


def _expected(names: set[str] | frozenset[str]) -> str:
    words = sorted({_describe(t) for t in names if not t.startswith("__") and t not in formula_syntax.UNMENTIONED})
    if not words:
        return ""
    if len(words) > 4:
        return ""
    return "expected " + (words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1])


def _token_text(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "_NL":
        return "end of line"
    return repr(str(tok))


def _end(source: str) -> tuple[int, int]:
    """Line and column just after the last character of the last line (1, 1 for no text)."""
    lines = source_lines(source) or [""]
    return len(lines), len(lines[-1]) + 1


def _syntax_error(exc: UnexpectedInput, file: str, source: str) -> SpecError:
    line = getattr(exc, "line", 0) or 0
    col = getattr(exc, "column", 0) or 0
    hint = None
    if isinstance(exc, UnexpectedCharacters):
        ch = source[exc.pos_in_stream] if exc.pos_in_stream < len(source) else ""
        msg = f"unexpected character {ch!r}"
        if formula_syntax.in_define(source, line) and ch in "'`\"":
            hint = "a formula holds numbers, names, operators and calls; no strings"
        elif ch in "'`":
            hint = 'the description is written in double quotes: "..."'
        elif ch == ".":
            hint = "names are plain words: no attribute access or dotted paths"
        elif ch == "\"":
            end = source.find("\n", exc.pos_in_stream)
            rest = source[exc.pos_in_stream:end if end >= 0 else len(source)].rstrip("\r")
            return SpecError("unterminated string", Span(file, line, col, len(rest)),
                             hint="a string must end on the same line", source=source)
        return SpecError(msg, Span(file, line, col, 1), hint=hint, source=source)
    if isinstance(exc, UnexpectedEOF):
        line, col = _end(source)
        exp = _expected(set(exc.expected))
        return SpecError("unexpected end of file" + (f", {exp}" if exp else ""),
                         Span(file, line, col, 1), source=source)
    assert isinstance(exc, UnexpectedToken)
    tok = exc.token
    ch = formula_syntax.outside_operator(tok, set(exc.accepts or exc.expected))
    if ch is not None:  # '-', '*', '<', ... where no formula can stand
        return SpecError(f"unexpected character {ch!r}", Span(file, line, col, 1), source=source)
    if tok.type == "_NL" and line > len(source_lines(source)):
        # the file's last line ends inside an open parenthesis: the line end the lexer reports
        # comes after the last line, where nothing can be shown; it is the end of the file
        tok = Token("$END", "")
    if tok.type == "$END":
        line, col = _end(source)
    elif tok.type == "_NL" and 1 <= line <= len(lines := source_lines(source)):
        col = len(lines[line - 1]) + 1  # just after the line's text (a comment may hold a '\r')
    accepts = formula_syntax.shown(set(exc.accepts or exc.expected))
    # before the header, blank lines are allowed too; "expected 'algorithm'" is what helps
    exp = _expected(accepts - {"_NL"} if "ALGORITHM" in accepts else accepts)
    length = len(str(tok)) if tok.type not in ("$END", "_NL") else 1
    msg = f"unexpected {_token_text(tok)}" + (f", {exp}" if exp else "")
    pos = tok.start_pos if tok.type != "$END" and tok.start_pos is not None else len(source)
    before = source[:pos].rstrip(" \t")
    if formula_syntax.in_define(source, line) and tok.type != "ALGORITHM":
        hint = formula_syntax.hint(tok, set(accepts), before)
    elif "ALGORITHM" in accepts:  # only the first line of a spec can take 'algorithm'
        hint = "a spec starts with: algorithm <name> [extends <parent>]"
    elif tok.type == "ALGORITHM":
        msg = "a second 'algorithm': a file holds one algorithm"
        hint = "put each algorithm in its own file; one may extend another"
    elif before.endswith(",") and tok.type in ("RPAR", "_NL", "$END"):
        hint = "remove the trailing ','" if tok.type == "RPAR" else \
            "a list ends on the line where it starts: join the lines, or remove the trailing ','"
    elif tok.type in ("_NL", "$END") and "RPAR" in accepts:
        hint = "close the argument list with ')' on the same line"
    elif tok.type == "SIGNED_NUMBER" and "EQUAL" not in accepts and "NAME" in accepts:
        hint = "arguments are named: component(name=value)"
    elif "EQUAL" in accepts:
        hint = "arguments are written name=value"
    elif tok.type in ("_NL", "$END") and "NAME" in accepts:
        hint = _lone_name_hint(before)
    elif tok.type == "STRING" and before.endswith('"'):
        hint = "a string cannot contain '\"'"
    return SpecError(msg, Span(file, line, col, length), hint=hint, source=source)


def _lone_name_hint(before: str) -> str | None:
    """A line that holds one name: a slot without its component, or a component without its slot."""
    words = before.rsplit("\n", 1)[-1].split("#", 1)[0].split()
    if words[:1] == ["algorithm"]:
        return "a spec starts with: algorithm <name> [extends <parent>]"
    if len(words) != 1:
        return None
    word = words[0]
    if word in registry.SLOTS:
        return f"slot '{word}' needs a component, e.g. `{word} {registry.SLOTS[word].default}`"
    owners = [s for s, comps in registry.REGISTRY.items() if word in comps]
    if len(owners) == 1:
        return f"a line is `<slot> <component>`: write `{owners[0]} {word}`"
    return "a line is `<slot> <component>`, e.g. `baseline group_mean`"


# ---------------------------------------------------------------------------------------
# Tree -> nodes


class _ToNodes(formula_syntax.FormulaNodes, Transformer):
    """Transformer methods named after the grammar's rules and aliases (formula rules: mixin)."""

    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def _w(self, tok: Token) -> Word:
        return Word(str(tok), Span(self.file, tok.line or 0, tok.column or 0, len(str(tok))))

    def header(self, items: list[Token]) -> tuple[Word, Word | None]:
        return self._w(items[0]), (self._w(items[1]) if len(items) > 1 else None)

    def description(self, items: list[Token]) -> tuple[str, Word]:
        return "description", self._w(items[0])

    def number(self, items: list[Token]) -> tuple[str, Word]:
        return "number", self._w(items[0])

    def word(self, items: list[Token]) -> tuple[str, Word]:
        return "word", self._w(items[0])

    def string(self, items: list[Token]) -> tuple[str, Word]:
        return "string", self._w(items[0])

    def arg(self, items: list[Any]) -> ArgNode:
        kind, value = items[1]
        return ArgNode(self._w(items[0]), kind, value)

    def component(self, items: list[Any]) -> ComponentNode:
        return ComponentNode(self._w(items[0]), tuple(a for a in items[1:] if isinstance(a, ArgNode)),
                             has_parens=len(items) > 1)

    def slot(self, items: list[Any]) -> tuple[str, SlotNode]:
        return "slot", SlotNode(self._w(items[0]), tuple(items[1:]))

    def start(self, items: list[Any]) -> SpecFile:
        name, extends = items[0]
        spec = SpecFile(self.file, "", name, extends)
        for kind, node in items[1:]:
            {"description": spec.descriptions, "slot": spec.slots, "define": spec.defines,
             "function": spec.functions}[kind].append(node)
        return spec


def parse(source: str, file: str = "<string>") -> SpecFile:
    """Parse spec text; raises :class:`SpecError` (never a Lark exception).

    A text parsed before in this process is not parsed again (``rldsl list`` reads the library,
    each spec's parents with it): the caller gets its own copy of the lists of the nodes."""
    if not isinstance(source, str):
        raise TypeError("spec source must be str")
    spec = _parse(source, file)
    return replace(spec, descriptions=list(spec.descriptions), slots=list(spec.slots), defines=list(spec.defines),
                   functions=list(spec.functions))


@functools.lru_cache(maxsize=256)
def _parse(source: str, file: str) -> SpecFile:
    if "\x00" in source:
        i = source.index("\x00")
        line = source.count("\n", 0, i) + 1
        col = i - (source.rfind("\n", 0, i) + 1) + 1
        raise SpecError("unexpected character '\\x00'", Span(file, line, col, 1),
                        hint="a spec is a plain text file", source=source)
    joined = _join_continued(source)
    try:
        tree = _parser().parse(joined)
    except UnexpectedInput as exc:
        if joined is not source:
            _relocate_error(exc, _LineStarts(source))
        raise _syntax_error(exc, file, source) from None
    except lark.exceptions.LarkError as exc:  # pragma: no cover - defensive
        raise SpecError(f"could not parse: {exc}", Span(file, 1, 1, 1), source=source) from None
    if joined is not source:
        _relocate(tree, _LineStarts(source))
    _check_depth(tree, file, source)
    spec = _ToNodes(file).transform(tree)
    spec.source = source
    return spec


#: How deeply a formula may nest (calls, operators, a sum's terms: ``a + b + c`` is two levels).
#: Every later stage (checking, emission, explain) walks the formula recursively, so a deeper
#: one is refused here, at the place where it passes the limit, instead of exhausting the stack.
MAX_DEPTH = 200


def _check_depth(tree: lark.Tree, file: str, source: str) -> None:
    """Refuse a parse tree nested deeper than :data:`MAX_DEPTH`, walked without recursion."""
    stack: list[tuple[lark.Tree, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            meta = node.meta
            line, col = getattr(meta, "line", 1), getattr(meta, "column", 1)
            end = getattr(meta, "end_column", col + 1) if getattr(meta, "end_line", line) == line else col + 1
            raise SpecError(f"formula nested more than {MAX_DEPTH} levels deep", Span(file, line, col, max(1, end - col)),
                            hint="split it into bindings: `x = ...` on its own line, then use x", source=source)
        for child in node.children:
            if isinstance(child, lark.Tree):  # only the formula's own operators and calls count
                stack.append((child, depth + str(child.data).startswith("f_")))


# ---------------------------------------------------------------------------------------
# Bindings continued over lines

#: the characters that end a formula line which continues on the next (an operator, an open
#: bracket, the ',' between arguments, a binding's '=')
_CONTINUES = ("+", "-", "*", "/", "^", ",", "=", "<", ">", "(", "[")


def _join_continued(source: str) -> str:
    """``source`` with the line ends inside a ``define`` block that a binding continues across
    blanked: a line whose brackets are still open, or that ends with an operator, goes on with
    the next line (unless that is ``end``), as in Python. The line end and a comment before it
    become spaces, so every character keeps its offset (:func:`_relocate` puts the lines back);
    text without such a line is returned as it is."""
    lines = source.split("\n")
    out: list[str] = []
    block = formula = continuing = changed = False  # in a define block; this line is a formula's
    depth = 0
    for i, line in enumerate(lines):
        code, hash_, comment = line.partition("#")
        words = code.split()
        if not continuing:
            if words[:1] == ["define"]:  # `define NAME` opens a block; `define f(x) = ...` is one formula
                block, formula = "=" not in code, "=" in code
            elif words == ["end"]:
                block = formula = False
            else:
                formula = block
        if formula:
            depth = max(0, depth + sum(map(code.count, "([")) - sum(map(code.count, ")]")))
            nxt = lines[i + 1].split("#", 1)[0].split() if i + 1 < len(lines) else None
            if nxt is not None and nxt != ["end"] and (depth > 0 or code.rstrip(" \t\r").endswith(_CONTINUES)):
                out.append((code + " " * len(hash_ + comment)).replace("\r", " ") + " ")  # '\n' -> ' '
                continuing = changed = True
                continue
        continuing, depth = False, 0
        out.append(line + "\n")
    if not changed:
        return source
    text = "".join(out)
    return text[:-1] if not source.endswith("\n") else text


class _LineStarts:
    """Offset -> (line, column), 1-based, in the text as written."""

    def __init__(self, source: str):
        self.starts = [0] + [i + 1 for i, c in enumerate(source) if c == "\n"]

    def __call__(self, pos: int) -> tuple[int, int]:
        line = bisect.bisect_right(self.starts, pos)
        return line, pos - self.starts[line - 1] + 1


def _relocate(tree: lark.Tree, where: _LineStarts) -> None:
    """Give every token and node of a tree parsed from joined lines its place in the text as written."""
    for node in tree.iter_subtrees():
        meta = node.meta
        if not meta.empty:
            meta.line, meta.column = where(meta.start_pos)
            meta.end_line, meta.end_column = where(meta.end_pos)
        for tok in node.children:
            if isinstance(tok, Token) and tok.start_pos is not None:
                tok.line, tok.column = where(tok.start_pos)
                if tok.end_pos is not None:
                    tok.end_line, tok.end_column = where(tok.end_pos)


def _relocate_error(exc: UnexpectedInput, where: _LineStarts) -> None:
    pos = getattr(exc, "pos_in_stream", None)
    tok = getattr(exc, "token", None)
    if isinstance(tok, Token) and tok.start_pos is not None and tok.type != "$END":
        tok.line, tok.column = where(tok.start_pos)
        pos = tok.start_pos
    if pos is not None:
        exc.line, exc.column = where(pos)
