"""The ``rldsl`` command line: check, explain, list (language) and run, plot (runtime).

Exit codes: 0 success, 1 invalid spec (every error printed as ``file:line:col: error: ...``),
2 usage error. A Python traceback appears only with ``--traceback``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import registry
from .errors import SpecError, SpecErrors

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="rldsl: declarative RL-for-LLM algorithms. `rldsl list` shows the components.")


class _Lazy:
    """A rich Console made when used, so that the current terminal width (or COLUMNS) applies."""

    def __init__(self, **kw: object):
        self.kw = kw

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(Console(highlight=False, **self.kw), name)


out = _Lazy()
err = _Lazy(stderr=True)


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


@app.command()
def check(files: List[str] = typer.Argument(..., help="spec files (or library names)"),
          traceback: bool = typer.Option(False, "--traceback", help="show Python tracebacks")) -> None:
    """Validate specs; print every error with file:line:col, the line, a caret and a hint."""
    from .spec import load
    failed = 0
    for f in files:
        try:
            algo = load(f)
        except SpecError as e:
            if traceback:
                raise
            failed += 1
            _print_error(e)
            continue
        parents = f" (extends {' -> '.join(algo.extends)})" if algo.extends else ""
        out.print(f"ok: {f}: algorithm {algo.name}{parents}", markup=False)
    if failed:
        n = sum(1 for _ in files)
        err.print(f"{failed} of {n} file{'s' if n > 1 else ''} invalid", markup=False)
        raise typer.Exit(1)


@app.command()
def explain(files: List[str] = typer.Argument(..., help="one spec to explain, or two to diff"),
            code: bool = typer.Option(False, "--code", help="print the exact generated source"),
            format: str = typer.Option("text", "--format", help="text or json"),
            traceback: bool = typer.Option(False, "--traceback")) -> None:
    """Explain an algorithm (slots, formulas, objective), or diff two algorithms slot by slot."""
    from . import explain as ex
    if format not in ("text", "json"):
        err.print(f"error: --format must be 'text' or 'json', not {format!r}", markup=False)
        raise typer.Exit(2)
    if len(files) > 2:
        err.print("error: explain takes one spec, or two to compare", markup=False)
        raise typer.Exit(2)
    algos = [_load_or_exit(f, traceback) for f in files]
    if len(algos) == 2:
        d = ex.diff(*algos)
        if format == "json":
            out.print_json(json.dumps(d))
            return
        _print_diff(d)
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
    head = f"{algo.name}" + (f" extends {' -> '.join(algo.extends)}" if algo.extends else "")
    out.print(head, style="bold", markup=False)
    if algo.description:
        out.print(f"  {algo.description}", markup=False)
    out.print(f"  {algo.file}", style="dim", markup=False)
    t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for c in ("slot", "component", "formula", "from"):
        t.add_column(c, overflow="fold")
    for row in ex.slot_rows(algo):
        params = ", ".join(f"{k}={ex._fmt(v)}" for k, v in row["params"].items() if v is not None)
        comp = row["component"] + (f"({params})" if params else "")
        t.add_row(row["slot"], comp, row["formula"], row["from"])
    out.print(t)
    out.print("\nobjective", style="bold")
    for line in ex.objective_lines(algo):
        out.print("  " + line, markup=False)


def _print_diff(d: dict) -> None:
    from .explain import _fmt
    out.print(f"{d['a']} ({d['a_file']})  vs  {d['b']} ({d['b_file']})", style="bold", markup=False)
    t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for c in ("slot", "", d["a"], d["b"], "from (a | b)"):
        t.add_column(c, overflow="fold")
    for s in d["slots"]:
        mark = {"same": "=", "params differ": "~", "component differs": "≠", "formula differs": "≠"}[s["status"]]
        style = None if s["status"] == "same" else "yellow"
        t.add_row(s["slot"], mark, s["a"], s["b"], f"{s['a_from']} | {s['b_from']}", style=style)
        for p in s.get("params", []):
            t.add_row("", "", f"  {p['param']}={_fmt(p['a'])}", f"  {p['param']}={_fmt(p['b'])}", "",
                      style="yellow")
        if "a_formula" in s:  # a formula against a registry component
            t.add_row("", "", f"  {s['a_formula']}", f"  {s['b_formula']}", "", style="yellow")
        for b in s.get("bindings", []):  # a formula against a formula
            t.add_row("", "", f"  {b['binding']} = {_fmt(b['a'])}", f"  {b['binding']} = {_fmt(b['b'])}", "",
                      style="yellow")
    out.print(t)
    out.print(f"{d['differences']} slot(s) differ", markup=False)


@app.command("list")
def list_components(slot: Optional[str] = typer.Argument(None, help="only this slot")) -> None:
    """The components of each slot with their parameters and formulas, and the algorithm library."""
    from .errors import did_you_mean
    from .spec import library, load
    if slot is not None and slot not in registry.SLOTS:
        hint = did_you_mean(slot, registry.SLOTS)
        err.print(f"error: unknown slot {slot!r}" + (f"; {hint}" if hint else ""), markup=False)
        raise typer.Exit(2)
    for s, spec in registry.SLOTS.items():
        if slot and s != slot:
            continue
        t = Table(title=f"{s} — {spec.doc}", title_justify="left", box=None, pad_edge=False,
                  header_style="bold")
        t.add_column("component")
        t.add_column("parameters", overflow="fold")
        t.add_column("formula", overflow="fold")
        for name, comp in registry.REGISTRY[s].items():
            params = "; ".join(f"{k}: {p.describe()}" for k, p in comp.params.items())
            t.add_row(name, params, comp.formula.splitlines()[0] if comp.formula else "")
        out.print(t)
        out.print()
    if slot is None:
        t = Table(title="algorithms (library)", title_justify="left", box=None, header_style="bold")
        t.add_column("name")
        t.add_column("extends")
        t.add_column("description", overflow="fold")
        for name in library():
            a = load(name)
            t.add_row(name, a.extends[0] if a.extends else "", a.description)
        out.print(t)


def _register_runtime() -> None:
    try:
        from .runtime.commands import register
    except ImportError as e:  # pragma: no cover - a broken install
        @app.command()
        def run() -> None:
            """(unavailable: the runtime could not be imported)"""
            err.print(f"error: the runtime is unavailable: {e}", markup=False)
            raise typer.Exit(2)
        return
    register(app)


_register_runtime()


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
