"""The ``rldsl`` command line: check, explain, list, translate (language) and run, plot, ...
(runtime).

Exit codes, the same for every command (``rldsl.cli_errors``): 0 ok, 1 a run failed,
2 usage or bad input (an invalid spec is printed as ``file:line:col: error: ...``, every error
of the file), 130 interrupted. A Python traceback appears only with ``--traceback``.

Output is literal: formulas such as ``1[max r != min r]``, spec descriptions and error
messages are never read as rich markup or emoji codes, and lines are never cut. Messages and
spec output are never wrapped (a path stays on one line, pasteable); ``rldsl list`` wraps its
long lines at spaces to the terminal's width, or to 100 columns when piped, each continuation
indented under its text.
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
from .cli_errors import reports_errors
from .errors import EXIT_BAD_INPUT, RunFailed, SpecError, TranslateError, UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,  # click's plain help: wrapped to the terminal, never cut
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


#: the width `rldsl list` wraps to when stdout is not a terminal (a pipe, a file)
PIPED_WIDTH = 100


def _wrap_offsets(plain: str, width: int, hanging: int) -> list[int]:
    """Where to break ``plain`` so the first line fits ``width`` and the others, indented by
    ``hanging``, fit too: at a space (dropped), else after a ``|`` of a list of choices; a word
    with neither stays whole."""
    offsets: list[int] = []
    start, limit = 0, width
    while len(plain) - start > limit:
        cut = plain.rfind(" ", start + 1, start + limit + 1)
        if cut <= start:
            bar = plain.rfind("|", start + 1, start + limit)
            if bar > start:
                offsets.append(bar + 1)  # the next line starts right after the bar
                start, limit = bar + 1, max(20, width - hanging)
                continue
            cut = plain.find(" ", start + limit)
            if cut == -1:
                break
        offsets.append(cut)
        start, limit = cut + 1, max(20, width - hanging)
    return offsets


def _print_lines(lines: list[list[tuple[str, str]]], wrap: bool = False) -> None:
    """Lines of literal (text, style) segments; styles show on a terminal only. Nothing wraps unless
    ``wrap``: then a long line breaks at spaces to the terminal's width (PIPED_WIDTH when piped), its
    continuation indented under its text (after a leading label segment that ends in two spaces)."""
    console = Console(highlight=False, markup=False, emoji=False, soft_wrap=True)
    width = console.width if console.is_terminal else PIPED_WIDTH
    for segments in lines:
        t = Text()
        for text, style in segments:
            t.append(text, style=style or None)
        plain = t.plain
        if not wrap or len(plain) <= width:
            console.print(t, soft_wrap=True)
            continue
        first = segments[0][0] if segments else ""
        hanging = len(first) if first.endswith("  ") and len(segments) > 1 else \
            len(plain) - len(plain.lstrip(" ")) + 2
        pieces = t.divide(_wrap_offsets(plain, width, hanging))
        console.print(pieces[0], soft_wrap=True)
        for piece in pieces[1:]:
            rest = piece[1:] if piece.plain.startswith(" ") else piece  # drop the space broken at
            console.print(Text(" " * hanging) + rest, soft_wrap=True)


def _print_error(e: SpecError) -> None:
    # plain text: spec content must never be interpreted as rich markup
    err.print(e.render(), markup=False, soft_wrap=True)


def _check_help() -> str:
    from . import lint
    rules = "\b\n" + lint.rules_text()  # \b: click keeps the lines as they are
    return ("Validate specs; print every error with file:line:col, the line, a caret and a hint.\n\n"
            "Legal specs that are almost surely slips get `file:line:col: warning: ...` the same "
            "way; they fail the check only with --strict. `rldsl run` prints them at its start, "
            "with the rules marked 'at run start' checked against the run's config. The rules:\n\n"
            + rules)


@app.command(help=_check_help())
@reports_errors
def check(files: List[str] = typer.Argument(..., help="spec files (or library names)"),
          strict: bool = typer.Option(False, "--strict", help="exit 2 on any warning too"),
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
        for w in warnings + lint.notes(algo):  # notes: facts worth knowing; --strict ignores them
            _print_error(w)
        warned += bool(warnings)
        parents = f" (extends {' -> '.join(algo.extends)})" if algo.extends else ""
        n_w = f" ({len(warnings)} warning{'s' if len(warnings) > 1 else ''})" if warnings else ""
        out.print(f"ok: {f}: algorithm {algo.name}{parents}{n_w}", markup=False)
    n = sum(1 for _ in files)
    if failed:
        err.print(f"{failed} of {n} file{'s' if n > 1 else ''} invalid", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT)
    if warned and strict:
        err.print(f"{warned} of {n} file{'s' if n > 1 else ''} with warnings (--strict)", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT)


@app.command()
@reports_errors
def explain(files: List[str] = typer.Argument(..., help="one spec to explain, or two to diff"),
            code: bool = typer.Option(False, "--code", help="print the exact generated source"),
            format: str = typer.Option("text", "--format", help="text or json"),
            show_all: bool = typer.Option(False, "--all", help="in a diff, also show the slots that are the same"),
            traceback: bool = typer.Option(False, "--traceback")) -> None:
    """Explain an algorithm (slots, formulas, objective), or diff two algorithms slot by slot."""
    from . import explain as ex
    from .spec import load
    if format not in ("text", "json"):
        raise UsageError(f"--format must be 'text' or 'json', not {format!r}")
    if len(files) > 2:
        raise UsageError("explain takes one spec, or two to compare")
    if show_all and len(files) != 2:
        raise UsageError("--all shows the identical slots of a diff: give two specs")
    algos = [load(f) for f in files]
    if len(algos) == 2:
        if format == "json":
            out.print_json(json.dumps(ex.diff(*algos)))
        else:
            _print_lines(ex.diff_lines(*algos, show_all=show_all))
        return
    algo = algos[0]
    if code:  # the source rldsl.compile runs (CompiledAlgorithm.source), generated without torch
        from .codegen import generate
        source = generate(algo).source
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
@reports_errors
def translate(config: str = typer.Argument(..., help="a TRL GRPOConfig (YAML/JSON, as `trl grpo --config` reads it) "
                                                     "or a verl trainer YAML"),
              name: Optional[str] = typer.Option(None, "--name", help="algorithm name (default: the file's stem)"),
              lenient: bool = typer.Option(False, "--lenient",
                                           help="print the closest spec even if options cannot be reproduced, "
                                                "each as a '# WARNING' line (exit 0)"),
              out_dir: Optional[Path] = typer.Option(None, "--out", metavar="DIR",
                                                     help="write DIR/spec.rl and DIR/run.toml instead of printing"),
              verify: bool = typer.Option(False, "--verify",
                                          help="run the peer's own loss code and the translated spec on the same "
                                               "random batches and print the largest difference (needs the peer "
                                               "library installed)"),
              traceback: bool = typer.Option(False, "--traceback", help="show Python tracebacks")) -> None:
    """Translate a TRL or verl config into a spec and a run config (TOML and --set flags).

    The format is detected: verl configs nest `algorithm:` / `actor_rollout_ref:`, TRL's are flat. Absent fields take the peer's default (TRL 1.16, verl 0.9.1). Options that do not change the algorithm are carried into run keys (learning rate, schedule and warm-up, model path, LoRA, dtype, ...) or listed as ignored with the reason. An algorithm option that no spec reproduces exactly is named with the reason, and the command exits 2; with --lenient it prints the rest, the option as a `# WARNING` comment. Exit 2 also when the file cannot be read or is neither format; 1 when --verify finds a difference.
    """  # noqa: E501 - one line per paragraph: typer rewraps it
    import re

    from . import translate as tr
    from .out_folder import check_out_folder
    from .spec import loads
    if out_dir is not None:  # before anything is read: a folder of the user's files is never written over
        check_out_folder(out_dir, TranslateError)
    cfg = tr.read_config(config)
    t = tr.translate(cfg)
    stem = re.sub(r"[^a-z0-9_]+", "_", (name or Path(config).stem).lower()).strip("_")
    algo_name = stem if re.fullmatch(r"[a-z][a-z0-9_]*", stem) else f"translated_{stem}".rstrip("_")
    if t.problems and not lenient:
        for p in t.problems:
            err.print(f"error: {config}: {t.peer} option {p.option} cannot be translated: {p.why}", markup=False)
        raise TranslateError(f"{len(t.problems)} option{'s' if len(t.problems) > 1 else ''} not translated; "
                             "--lenient prints the rest with a warning comment for each")
    spec_text = t.spec_text(algo_name, config)
    try:
        loads(spec_text, f"<translated {config}>")
    except SpecError as e:  # a value out of the spec's range (e.g. a clip epsilon >= 1)
        _print_error(e)
        raise TranslateError(f"{config}: the translated spec is invalid (above)") from None
    if out_dir is not None:
        spec_path, toml_path = tr.write_out(t, config, algo_name, out_dir)
        out.print(f"wrote {spec_path}\nwrote {toml_path}\nrun it: rldsl run {spec_path} --config {toml_path}",
                  markup=False)
    else:
        sys.stdout.write(tr.render(t, config, algo_name, lenient=lenient))
    if verify:
        from .verify import verify_translation
        report = verify_translation(cfg, t, spec_text)
        where = out if out_dir is not None else err  # printed specs keep stdout to themselves
        for line in report.lines:
            where.print(line, markup=False)
        if not report.ok:
            raise RunFailed(f"--verify: the translated spec differs from {t.peer}'s own loss (above)")


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
@reports_errors
def list_components(slot: Optional[str] = typer.Argument(None, help="only this slot")) -> None:
    """The components of each slot with their parameters and formulas, and the algorithm library."""
    from .suggest import did_you_mean
    if slot is not None and slot not in registry.SLOTS:
        hint = did_you_mean(slot, registry.SLOTS)
        raise UsageError(f"unknown slot {slot!r}" + (f"; {hint}" if hint else ""))
    _print_lines(list_lines(slot), wrap=True)


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


def _whole_short_help() -> None:
    """`rldsl --help` lists each command with its first paragraph whole (click would cut it to
    the width with "..."); the terminal wraps the line."""
    import inspect
    for info in app.registered_commands:
        text = info.help or inspect.getdoc(info.callback) or ""
        if info.short_help is None and text:
            info.short_help = " ".join(text.split("\n\n", 1)[0].split())


_whole_short_help()


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
