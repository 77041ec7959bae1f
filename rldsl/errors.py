"""The exit-code scheme of every ``rldsl`` command, the base of every error worded for the user,
and the language's errors, which point at the spec source: ``file:line:col: error: ...``, the
line, a caret span, a hint.

Every problem with user input (a spec file, a name, a value) is a :class:`SpecError`; a
file with several problems raises :class:`SpecErrors`, which holds all of them so that
``rldsl check`` can report every one.

Every error a user may see is a :class:`UserError` with its exit code as the class attribute
``exit_code``; the language's live here, the runtime's in ``rldsl.runtime.errors``. docs/errors.md
lists each with its message, cause and fix.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Span:
    """A place in a spec file: 1-based line and column, and the length of the token."""

    file: str = "<string>"
    line: int = 0
    column: int = 0
    length: int = 1


def source_lines(source: str) -> list[str]:
    """The lines of ``source`` as the parser numbers them: split at '\\n' only (a form feed or
    U+2028 inside a comment does not start a line), without the line ends."""
    lines = source.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


@functools.lru_cache(maxsize=4)
def _lines_of(source: str) -> tuple[str, ...]:
    """:func:`source_lines`, split once per text: every error of a file renders one of its lines,
    and splitting the whole text for each would make reporting N errors quadratic in N. (A str
    keeps its hash, and the errors of one file share one text object, so a lookup is O(1).)"""
    return tuple(source_lines(source))


#: The exit codes of every command (docs/errors.md).
EXIT_OK = 0
EXIT_FAILED = 1        # the run (or the command's work) failed on good input
EXIT_BAD_INPUT = 2     # usage or bad input: a bad spec, config, model path, reward, data file, ...
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)


class UserError(Exception):
    """An error worded for the user: a command prints its message (no traceback unless
    ``--traceback``) and exits with ``exit_code``."""

    exit_code: int = EXIT_BAD_INPUT

    def render(self) -> str:
        """The whole message as a command prints it: ``error: ...`` (a spec error: ``file:line:col:
        error: ...`` with the line and a caret)."""
        return f"error: {self}"


class SpecError(UserError):
    """One error in a spec, located at ``span`` within ``source`` (the whole file text)."""

    severity = "error"
    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, span: Span | None = None, *, hint: str | None = None,
                 source: str | None = None):
        super().__init__(message)
        self.message = message
        self.span = span or Span()
        self.hint = hint
        self.source = source

    @property
    def file(self) -> str:
        return self.span.file

    @property
    def line(self) -> int:
        return self.span.line

    @property
    def column(self) -> int:
        return self.span.column

    def render(self) -> str:
        """The compiler-style report: location line, source line with a caret span, hint."""
        s = self.span
        head = f"{s.file}:{s.line}:{s.column}: {self.severity}: {self.message}" if s.line else \
            f"{s.file}: {self.severity}: {self.message}"
        out = [head]
        lines = _lines_of(self.source or "")
        if s.line and 1 <= s.line <= len(lines):
            # one character per column, as the parser counts them: tabs and control characters
            # (a NUL byte, a form feed) are shown as one visible character each
            text = "".join(c if c.isprintable() else " " if c == "\t" else "\ufffd"
                           for c in lines[s.line - 1])
            gutter = f"{s.line:>4} | "
            out.append(gutter + text)
            col = max(s.column, 1)
            width = max(1, min(s.length, max(1, len(text) - col + 1)))
            out.append(" " * (len(gutter) - 2) + "| " + " " * (col - 1) + "^" + "~" * (width - 1))
        if self.hint:
            out.append(f"     = help: {self.hint}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()


class SpecWarning(SpecError):
    """A legal spec that is almost surely a slip (rldsl/lint.py): rendered like an error with
    ``warning:``; never raised by the loader. ``rule`` names the check that found it."""

    severity = "warning"

    def __init__(self, rule: str, message: str, span: Span | None = None, *, hint: str | None = None,
                 source: str | None = None):
        super().__init__(message, span, hint=hint, source=source)
        self.rule = rule


class SpecErrors(SpecError):
    """Several errors of one file; ``errors`` lists them in source order."""

    def __init__(self, errors: Sequence[SpecError]):
        # files in the order they were reported (a child before the parent it blames), then by position
        files: dict[str, int] = {}
        for e in errors:
            files.setdefault(e.span.file, len(files))
        errs = sorted(errors, key=lambda e: (files[e.span.file], e.span.line, e.span.column))
        self.errors = list(errs)
        first = self.errors[0]
        super().__init__(first.message, first.span, hint=first.hint, source=first.source)

    def render(self) -> str:
        n = len(self.errors)
        body = "\n\n".join(e.render() for e in self.errors)
        return body if n == 1 else f"{body}\n\n{n} errors"


class UsageError(UserError):
    """A command line that cannot be carried out as given (a bad option value, a wrong number
    of arguments, an unknown slot name)."""

    exit_code = EXIT_BAD_INPUT


class RunFailed(UserError):
    """A command's work failed on good input: ablation cells that did not finish, a translation
    that ``--verify`` finds different from the peer's code."""

    exit_code = EXIT_FAILED


class Interrupted(UserError):
    """Ctrl-C; a run that has saved a checkpoint names the command that continues it."""

    exit_code = EXIT_INTERRUPTED


class TranslateError(UserError):
    """``rldsl translate``: the file cannot be read, is neither a TRL GRPOConfig nor a verl
    trainer config, or holds an algorithm option that no spec reproduces."""

    exit_code = EXIT_BAD_INPUT


class ErrorList:
    """Collects SpecErrors while checking a file, so that all of them are reported."""

    def __init__(self, source: str | None = None):
        self.source = source
        self.items: list[SpecError] = []

    def add(self, message: str, span: Span, hint: str | None = None) -> None:
        self.items.append(SpecError(message, span, hint=hint, source=self.source))

    def extend(self, errors: Iterable[SpecError]) -> None:
        for e in errors:
            if e.source is None:
                e.source = self.source
            self.items.append(e)

    def raise_if_any(self) -> None:
        if self.items:
            raise SpecErrors(self.items) if len(self.items) > 1 else self.items[0]
