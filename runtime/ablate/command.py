"""``rldsl ablate``: a grid of spec variants x seeds, run in parallel, and its report (the
command's options are declared in rldsl/runtime/cli.py).

Exit codes (docs/errors.md): 0 every cell finished; 1 some cell failed or its spec is invalid
(the others ran; the report lists it); 2 a bad command line, BASE spec, grid file or ``--set``
key, or a study folder that holds another grid; 130 interrupted (run the same command again
to resume).
"""
from __future__ import annotations

import json
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from rich.console import Console

from rldsl.config_files import to_toml
from rldsl.errors import Interrupted, RunFailed, UsageError
from rldsl.out_folder import check_out_folder
from rich.live import Live
from rich.table import Table

from ..errors import GridError
from .grid import CELLS_DIR, Study, Variant, build_study, read_grid_file, write_cells
from .report import STUDY_FILE, load_study_file, write_report
from .launch import (Cell, CellStatus, LocalExecutor, RayExecutor, default_jobs, run_cells,
                     unfinished)

__all__ = ["ablate", "STUDIES_DIR"]

STUDIES_DIR = "studies"
GRID_FILE = "grid.toml"

_STYLE = {"done": "green", "running": "cyan", "failed": "red", "invalid": "red",
          "interrupted": "yellow", "pending": "dim"}


class Display:
    """One line per cell as it ends (or is found finished); a live table on a terminal."""

    def __init__(self, console: Console, cells: Sequence[Cell], statuses: dict[str, CellStatus],
                 steps: int):
        self.console, self.cells, self.statuses, self.steps = console, cells, statuses, steps
        self.ended = 0
        self.live: Live | None = None
        if console.is_terminal:
            self.live = Live(self._table(), console=console, refresh_per_second=2,
                             transient=True)

    def __enter__(self) -> "Display":
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.stop()

    def _table(self) -> Table:
        table = Table(title="cells", title_justify="left", header_style="bold")
        for name, justify in (("variant", "left"), ("seed", "right"), ("status", "left"),
                              ("step", "right"), ("acc", "right"), ("seconds", "right")):
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for cell in self.cells:
            st = self.statuses.get(cell.name)
            if st is None:
                continue
            acc = f"{st.acc:.3f}" if st.acc is not None else ""
            secs = "" if st.seconds is None else f"{st.seconds:.0f}"
            table.add_row(cell.variant.label, str(cell.seed), st.status, f"{st.step}/{self.steps}",
                          acc, secs, style=_STYLE.get(st.status))
        return table

    def notify(self, cell: Cell, st: CellStatus, event: str) -> None:
        if event != "end":
            return
        self.ended += 1
        width = len(str(len(self.cells)))
        what = "done (finished earlier)" if st.action == "skip" and st.status == "done" else st.status
        if st.status == "done" and st.action == "resume":
            what = "done (resumed)"
        parts = [f"[{self.ended:>{width}}/{len(self.cells)}] {cell.name}: {what}",
                 f"step {st.step}/{self.steps}"]
        if st.acc is not None:
            parts.append(f"acc {st.acc:.3f}")
        if st.seconds is not None and st.action != "skip":
            parts.append(f"{st.seconds:.0f} s")
        if st.status != "done" and st.error:
            first = next((ln for ln in st.error.splitlines() if "error" in ln.lower()),
                         st.error.splitlines()[-1])
            parts.append(first.strip())
        self.console.print(" | ".join(parts), markup=False, highlight=False, soft_wrap=True)

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(self._table())


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM acts as Ctrl-C: the running cells are stopped with a checkpoint each."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _variant_record(v: Variant) -> dict[str, Any]:
    return {"name": v.name, "label": v.label, "choices": [list(c) for c in v.choices],
            "is_base": v.is_base, "error": v.error, "changes": v.changes, "diff_rows": v.diff_rows}


def _check_folder(folder: Path, study: Study) -> None:
    """Refuse a study folder that holds another grid (other base, axes, mode or --set)."""
    check_out_folder(folder, GridError, empty=False)
    if not (folder / STUDY_FILE).is_file():
        if folder.exists() and any(p.name != CELLS_DIR for p in folder.iterdir()):
            raise GridError(f"--out {folder} exists and is not a study folder; choose another")
        return
    saved = load_study_file(folder).get("definition", {})
    mine = study.definition()
    for key in mine:
        if saved.get(key) != mine[key]:
            what = {"base": "the base spec", "base_source": "the base spec's text",
                    "base_parents": "the base spec's parents", "axes": "the --vary axes",
                    "one_at_a_time": "--one-at-a-time", "set": "the --set keys"}[key]
            raise GridError(f"{folder} holds another study (changed: {what}); running a study "
                            f"again may change only --seeds, --steps, --threshold and --jobs: "
                            f"choose another --out (saved: {json.dumps(saved.get(key))[:200]})")


def _save_grid(folder: Path, study: Study) -> Path:
    """``grid.toml``: the study as a grid file, so that ``rldsl ablate --grid`` reruns it."""
    base = study.base_algo
    lib = not (folder / CELLS_DIR / f"{base.name}.rl").is_file()
    vary = [f"{axis.key}: " + " | ".join(f"{a.label} = {a.text}" for a in axis.alternatives)
            for axis in study.axes]
    keys = {"name": study.name, "base": base.name if lib else f"{CELLS_DIR}/{base.name}.rl",
            "one_at_a_time": study.one_at_a_time, "seeds": len(study.seeds), "steps": study.steps,
            "threshold": study.threshold, "set": study.sets, "vary": vary}
    text = to_toml(keys, header="Written by `rldsl ablate`: this study as a grid file. Rerun (or resume) "
                                "it with\n  rldsl ablate --grid " + f"{folder / GRID_FILE} --out {folder}")
    (folder / GRID_FILE).write_text(text, encoding="utf-8")
    return folder / GRID_FILE


def _save_study(folder: Path, study: Study, variants: Sequence[Variant],
                session: dict[str, Any] | None = None) -> None:
    """``study.json``: the definition, the variants with their diffs, and the wall time of
    every invocation (``session`` is this one's, appended once it is over)."""
    grid = _save_grid(folder, study)
    sessions = []
    if (folder / STUDY_FILE).is_file():
        sessions = load_study_file(folder).get("sessions", [])
    if session is not None:
        sessions.append(session)
    data = {"name": study.name, "base": study.base_algo.name, "base_file": study.base_algo.file,
            "definition": study.definition(), "seeds": study.seeds, "steps": study.steps,
            "threshold": study.threshold,
            "command": f"rldsl ablate --grid {grid} --out {folder}",
            "variants": [_variant_record(v) for v in variants], "sessions": sessions}
    tmp = folder / f".{STUDY_FILE}.tmp"
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(folder / STUDY_FILE)


def _options(base: Optional[str], grid: Optional[Path], cli: dict[str, Any]) -> dict[str, Any]:
    """The grid file's keys, overridden by the flags given (``--set`` is appended)."""
    opts: dict[str, Any] = read_grid_file(grid) if grid is not None else {}
    if base is not None:
        opts["base"] = base
    for key, value in cli.items():
        if key == "set":
            opts["set"] = list(opts.get("set", [])) + list(value or [])
        elif value not in (None, []):
            opts[key] = value
    if "base" not in opts:
        raise GridError("missing BASE: give a spec (lite_ppo, algorithms/grpo.rl) or a grid "
                        "file with `base = ...` (--grid FILE)")
    return opts


def ablate(base: Optional[str] = None, vary: Optional[list[str]] = None, one_at_a_time: Optional[bool] = None,
           seeds: Optional[int] = None, steps: Optional[int] = None, set_: Optional[list[str]] = None,
           jobs: Optional[int] = None, out: Optional[Path] = None, grid: Optional[Path] = None,
           threshold: Optional[float] = None, ray_address: Optional[str] = None, report: Optional[Path] = None,
           traceback: bool = False) -> None:
    """``rldsl ablate`` (its options: rldsl/runtime/cli.py): build the study, run its cells, write the report."""
    console = Console(highlight=False, soft_wrap=True)  # piped output is never cut at 80 columns
    if report is not None:
        if base is not None or vary or grid is not None:
            raise UsageError("--report DIR only rebuilds a report (optionally with another "
                             "--threshold): give no BASE, --vary or --grid")
        try:
            path = write_report(report, threshold)
        except (FileNotFoundError, json.JSONDecodeError) as exc:
            raise UsageError(str(exc)) from exc
        console.print(str(path), markup=False)
        return

    from ..config import load_config
    from ..errors import ConfigError

    # a bad grid, BASE or --set raises a UserError: exit 2 (rldsl.cli_errors)
    opts = _options(base, grid, {"vary": vary, "one_at_a_time": one_at_a_time, "seeds": seeds,
                                 "steps": steps, "set": set_, "jobs": jobs,
                                 "threshold": threshold, "ray_address": ray_address})
    study = build_study(opts["base"], opts.get("vary", []),
                        one_at_a_time=bool(opts.get("one_at_a_time", False)),
                        seeds=int(opts.get("seeds", 3)), steps=opts.get("steps"),
                        sets=opts.get("set", []), threshold=float(opts.get("threshold", 0.5)),
                        name=opts.get("name"))
    folder = (out if out is not None else Path(STUDIES_DIR) / f"{study.name}-{study.digest()}")
    folder = folder.resolve()
    _check_folder(folder, study)
    save_final = load_config(None, study.sets).checkpoint.save_final

    folder.mkdir(parents=True, exist_ok=True)
    variants, dropped = write_cells(study, folder)
    for v in dropped:
        console.print(f"note: {v.label} equals the base; it is not run again", markup=False)
    _save_study(folder, study, variants)
    cells = [Cell(variant=v, seed=s, folder=folder) for v in variants for s in study.seeds]

    try:
        executor = (RayExecutor(opts["ray_address"], opts.get("jobs")) if opts.get("ray_address")
                    else LocalExecutor(int(opts.get("jobs") or default_jobs())))
    except Exception as exc:  # noqa: BLE001 - Ray missing or the cluster unreachable
        if traceback:
            raise
        raise ConfigError(f"--ray-address {opts['ray_address']}: {type(exc).__name__}: {exc}"
                          if opts.get("ray_address") else f"{type(exc).__name__}: {exc}") from exc
    console.print(f"study {folder}: {len(variants)} variants x {len(study.seeds)} seeds = "
                  f"{len(cells)} cells, {study.steps} steps each, {executor.jobs} at a time",
                  markup=False)
    statuses: dict[str, CellStatus] = {}
    display = Display(console, cells, statuses, study.steps)
    interrupted = False
    t0 = time.time()
    try:
        with display, _sigterm_interrupts():
            run_cells(cells, study, executor, save_final=save_final, notify=display.notify,
                      refresh=display.refresh, statuses=statuses)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        executor.close()
    ran = sum(s.action not in ("skip", "") for s in statuses.values())
    _save_study(folder, study, variants, {"seconds": round(time.time() - t0, 1),
                                          "jobs": executor.jobs, "cells_run": ran})
    path = write_report(folder)
    bad = unfinished(statuses.values())
    console.print(f"report: {path}", markup=False)
    if interrupted:
        raise Interrupted(f"interrupted; {bad} of {len(cells)} cells did not finish. Run the same "
                          f"command again to resume them.")
    if bad:
        raise RunFailed(f"{bad} of {len(cells)} cells did not finish (failed or invalid); see {path}")
