"""The ``rldsl`` command line: check, explain, list (language) and run, plot (runtime).

Exit codes: 0 success, 1 invalid spec (every error printed as ``file:line:col: error: ...``),
2 usage error. A Python traceback appears only with ``--traceback``.

Output is literal: formulas such as ``1[max r != min r]``, spec descriptions and error
messages are never read as rich markup or emoji codes, and lines are never cut to the
terminal width (a terminal or pager wraps them), so piped output reads like the screen.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from importlib.metadata import entry_points
from typing import List, Optional

import typer
from rich.console import Console
from rich.text import Text

from . import registry
from .errors import SpecError, SpecErrors

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="rldsl: declarative RL-for-LLM algorithms. `rldsl list` shows the components.")


class _Lazy:
    """A rich Console made when used (so the current stream applies) that prints text
    literally: no markup, no emoji codes, no highlighting."""

    def __init__(self, **kw: object):
        self.kw = kw

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(Console(highlight=False, markup=False, emoji=False, soft_wrap=True, **self.kw), name)


out = _Lazy()
err = _Lazy(stderr=True)


def _print_lines(lines: list[list[tuple[str, str]]]) -> None:
    """Lines of literal (text, style) segments; styles show on a terminal only, nothing wraps."""
    console = Console(highlight=False, markup=False, emoji=False, soft_wrap=True)
    for segments in lines:
        t = Text()
        for text, style in segments:
            t.append(text, style=style or None)
        console.print(t, soft_wrap=True)


def _print_error(e: SpecError) -> None:
    # plain text: spec content must never be interpreted as rich markup
    err.print(e.render(), markup=False, soft_wrap=True)


def _load_or_exit(path: str, traceback: bool):
    from .spec import load
    try:
        return load(path)
    except SpecError as e:
        if traceback:
            raise
        _print_error(e)
        raise typer.Exit(1) from None


def _check_help() -> str:
    from . import lint
    rules = "\b\n" + lint.rules_text()  # \b: click keeps the lines as they are
    return ("Validate specs; print every error with file:line:col, the line, a caret and a hint.\n\n"
            "Legal specs that are almost surely slips get `file:line:col: warning: ...` the same "
            "way; they fail the check only with --strict. `rldsl run` prints them at its start, "
            "with the rules marked 'at run start' checked against the run's config. The rules:\n\n"
            + rules)


@app.command(help=_check_help())
def check(files: List[str] = typer.Argument(..., help="spec files (or library names)"),
          strict: bool = typer.Option(False, "--strict", help="exit 1 on any warning too"),
          traceback: bool = typer.Option(False, "--traceback", help="show Python tracebacks")) -> None:
    from . import lint
    from .spec import load
    failed = warned = 0
    for f in files:
        try:
            algo = load(f)
        except SpecError as e:
            if traceback:
                raise
            failed += 1
            _print_error(e)
            continue
        warnings = lint.check(algo)
        for w in warnings:
            _print_error(w)
        warned += bool(warnings)
        parents = f" (extends {' -> '.join(algo.extends)})" if algo.extends else ""
        n_w = f" ({len(warnings)} warning{'s' if len(warnings) > 1 else ''})" if warnings else ""
        out.print(f"ok: {f}: algorithm {algo.name}{parents}{n_w}", markup=False)
    n = sum(1 for _ in files)
    if failed:
        err.print(f"{failed} of {n} file{'s' if n > 1 else ''} invalid", markup=False)
        raise typer.Exit(1)
    if warned and strict:
        err.print(f"{warned} of {n} file{'s' if n > 1 else ''} with warnings (--strict)", markup=False)
        raise typer.Exit(1)


@app.command()
def explain(files: List[str] = typer.Argument(..., help="one spec to explain, or two to diff"),
            code: bool = typer.Option(False, "--code", help="print the exact generated source"),
            format: str = typer.Option("text", "--format", help="text or json"),
            show_all: bool = typer.Option(False, "--all", help="in a diff, also show the slots that are the same"),
            traceback: bool = typer.Option(False, "--traceback")) -> None:
    """Explain an algorithm (slots, formulas, objective), or diff two algorithms slot by slot."""
    from . import explain as ex
    if format not in ("text", "json"):
        err.print(f"error: --format must be 'text' or 'json', not {format!r}")
        raise typer.Exit(2)
    if len(files) > 2:
        err.print("error: explain takes one spec, or two to compare")
        raise typer.Exit(2)
    if show_all and len(files) != 2:
        err.print("error: --all shows the identical slots of a diff: give two specs")
        raise typer.Exit(2)
    algos = [_load_or_exit(f, traceback) for f in files]
    if len(algos) == 2:
        if format == "json":
            out.print_json(json.dumps(ex.diff(*algos)))
        else:
            _print_lines(ex.diff_lines(*algos, show_all=show_all))
        return
    algo = algos[0]
    if code:
        from .compiled import compile as compile_algo
        source = compile_algo(algo, compile=False).source
        if format == "json":
            out.print_json(json.dumps({"name": algo.name, "source": source}))
        else:
            sys.stdout.write(source)
        return
    if format == "json":
        out.print_json(json.dumps(ex.to_dict(algo)))
        return
    _print_lines(ex.explain_lines(algo))


@app.command()
def translate(config: str = typer.Argument(..., help="a TRL GRPOConfig (JSON/YAML of its fields) or a verl trainer YAML"),
              name: Optional[str] = typer.Option(None, "--name", help="algorithm name (default: the file's stem)"),
              lenient: bool = typer.Option(False, "--lenient",
                                           help="print the closest spec even if options cannot be reproduced, "
                                                "each as a '# WARNING' line (exit 0)")) -> None:
    """Print the spec and the run config (TOML and --set flags) equivalent to a TRL or verl config.

    The format is detected: verl configs nest `algorithm:` / `actor_rollout_ref:`, TRL's are flat. Absent fields take the peer's default (TRL 1.16, verl 0.9.1). An option that no spec reproduces exactly is named with the reason, and the command exits 1; with --lenient it prints the rest, the option as a `# WARNING` comment. Exit 2: the file cannot be read or is neither format.
    """  # noqa: E501 - one line per paragraph: typer rewraps it
    import re

    from . import translate as tr
    from .spec import loads
    try:
        t = tr.translate(tr.read_config(config))
    except tr.TranslateError as e:
        err.print(f"error: {e}", markup=False)
        raise typer.Exit(2) from None
    stem = re.sub(r"[^a-z0-9_]+", "_", (name or Path(config).stem).lower()).strip("_")
    algo_name = stem if re.fullmatch(r"[a-z][a-z0-9_]*", stem) else f"translated_{stem}".rstrip("_")
    if t.problems and not lenient:
        for p in t.problems:
            err.print(f"error: {config}: {t.peer} option {p.option} cannot be translated: {p.why}", markup=False)
        err.print(f"{len(t.problems)} option{'s' if len(t.problems) > 1 else ''} not translated; "
                  "--lenient prints the rest with a warning comment for each", markup=False)
        raise typer.Exit(1)
    text = tr.render(t, config, algo_name, lenient=lenient)
    try:
        loads(t.spec_text(algo_name, config), f"<translated {config}>")
    except SpecError as e:  # a value out of the spec's range (e.g. a clip epsilon >= 1)
        _print_error(e)
        err.print(f"error: {config}: the translated spec is invalid (above)", markup=False)
        raise typer.Exit(1) from None
    sys.stdout.write(text)


def list_lines(slot: Optional[str] = None) -> list[list[tuple[str, str]]]:
    """``rldsl list``: per slot its components with their whole formulas, parameters and facts,
    one item per line; then the algorithm library."""
    from .explain import fact_notes
    from .spec import library, load
    lines: list[list[tuple[str, str]]] = []
    for s, spec in registry.SLOTS.items():
        if slot and s != slot:
            continue
        lines.append([(f"{s} — {spec.doc}", "bold")])
        what = {"declare": "declared for the checker", "data": "carried out by the runtime"}
        lines.append([(f"  {spec.stage} stage; components are called as {spec.signature}"
                       if spec.signature != "-" else f"  {what.get(spec.stage, spec.stage)}; no function",
                       "dim")])
        comps = registry.REGISTRY[s]
        w = max(len(n) for n in comps)
        pad = " " * (2 + w + 2)
        for name, comp in comps.items():
            formula = comp.formula.splitlines() or [""]
            lines.append([(f"  {name:<{w}}  ", "bold"), (formula[0], "")])
            lines += [[(pad + f, "")] for f in formula[1:]]
            for k, p in comp.params.items():
                lines.append([(pad + f"{k}: {p.describe()}" + (f" — {p.doc}" if p.doc else ""), "dim")])
            notes = fact_notes(comp)
            if notes:
                lines.append([(pad + "; ".join(notes), "dim")])
        lines.append([])
    if slot is None:
        lines.append([("algorithms (library)", "bold")])
        algos = [load(name) for name in library()]
        w = max(len(a.name) for a in algos)
        we = max(len(f"extends {a.extends[0]}") if a.extends else 0 for a in algos)
        for a in algos:
            parent = f"extends {a.extends[0]}" if a.extends else ""
            lines.append([(f"  {a.name:<{w}}  ", "bold"), (f"{parent:<{we}}  ", "dim"), (a.description, "")])
    return lines


@app.command("list")
def list_components(slot: Optional[str] = typer.Argument(None, help="only this slot")) -> None:
    """The components of each slot with their parameters and formulas, and the algorithm library."""
    from .errors import did_you_mean
    if slot is not None and slot not in registry.SLOTS:
        hint = did_you_mean(slot, registry.SLOTS)
        err.print(f"error: unknown slot {slot!r}" + (f"; {hint}" if hint else ""))
        raise typer.Exit(2)
    _print_lines(list_lines(slot))


#: the entry point group through which installed packages add commands (the runtime adds
#: run, plot, samples, export, reward and ablate; pyproject.toml declares it)
COMMANDS_GROUP = "rldsl.commands"


def _register_commands() -> None:
    """Add the commands other packages register under COMMANDS_GROUP: each entry point is a
    function that takes the Typer app. The language package never imports them itself."""
    for ep in entry_points(group=COMMANDS_GROUP):
        try:
            register = ep.load()
        except ImportError as e:  # pragma: no cover - a broken install
            _unavailable(ep.name, e)
            continue
        register(app)


def _unavailable(name: str, e: ImportError) -> None:  # pragma: no cover - a broken install
    @app.command("run")
    def run() -> None:
        """(unavailable: the commands of an installed package could not be imported)"""
        err.print(f"error: the {name} commands are unavailable: {e}", markup=False)
        raise typer.Exit(2)


_register_commands()


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
