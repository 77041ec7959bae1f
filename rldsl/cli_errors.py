"""How every ``rldsl`` command ends on an error: one decorator applies the exit-code scheme.

    0    ok
    1    the run (or the command's work) failed on good input
    2    usage or bad input: a bad spec, config, model path, reward, data file, grid, ...
    130  interrupted (Ctrl-C)

A :class:`~rldsl.errors.UserError` prints its message (``error: ...``) and exits with its
class's ``exit_code``; Ctrl-C exits 130; any other exception is a failure (1) shown as its
type and message, with a hint to rerun with ``--traceback`` where the command has that flag.
With ``--traceback`` every exception propagates with its traceback. Messages go to stderr
unwrapped (a path on its own line stays pasteable). docs/errors.md lists every error.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, TypeVar

import click
import typer

from .errors import EXIT_FAILED, EXIT_INTERRUPTED, UserError

__all__ = ["reports_errors", "print_error"]

F = TypeVar("F", bound=Callable[..., Any])


def print_error(text: str) -> None:
    """One message to stderr as it is: no markup, no wrapping."""
    typer.echo(text, err=True)


def reports_errors(command: F) -> F:
    """Wrap a typer command so that its errors end as the scheme above says."""
    has_traceback = "traceback" in inspect.signature(command).parameters

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        traceback = bool(kwargs.get("traceback", False))
        try:
            return command(*args, **kwargs)
        except (typer.Exit, click.exceptions.Exit, click.ClickException, click.Abort):
            raise  # typer's own endings: already reported
        except KeyboardInterrupt:
            if traceback:
                raise
            print_error("interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except UserError as exc:
            if traceback:
                raise
            print_error(exc.render())
            raise typer.Exit(exc.exit_code) from None
        except Exception as exc:  # noqa: BLE001 - a failure: reported, traceback on request
            if traceback:
                raise
            hint = "\n(run again with --traceback to see where)" if has_traceback else ""
            print_error(f"error: {type(exc).__name__}: {exc}{hint}")
            raise typer.Exit(EXIT_FAILED) from None

    return wrapper  # type: ignore[return-value]
