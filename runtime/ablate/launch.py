"""Running the cells of a study: one ``rldsl run`` process per cell, in parallel.

Each cell is driven through the public command line only::

    python -m rldsl.cli run <study>/cells/<variant>.rl --out <study>/runs/<variant>-s<seed>
                            --seed <seed> --steps <S> --set <key=value> ...
    python -m rldsl.cli run --resume <study>/runs/<variant>-s<seed> --steps <S>

and judged by its run folder: a run whose ``metrics.jsonl`` reaches step S (and whose
newest checkpoint is step S, when the config saves a final one) is finished and skipped;
a run with a checkpoint is resumed from it; a run folder without any checkpoint (a run
killed before its first one) is started again. Child processes get one thread each
(``OMP_NUM_THREADS=1``; ``threads`` stays the run config's, 1 by default) and write
their output to ``<study>/logs/<cell>.log``.

Processes run on a local thread pool (``--jobs``, default the machine's cores) or as
Ray tasks (``--ray-address``): both execute :func:`run_process`, so the two paths
differ only in who calls it. With Ray, every node must see the study folder and the
caller's working directory at the same paths, and have rldsl installed where the
driver has it.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ..records.checkpoint import latest_checkpoint
from ..records.metrics import GREEDY_ACC, read_metrics
from ..records.run_dir import METRICS_FILE
from .grid import CELLS_DIR, Study, Variant

__all__ = ["RUNS_DIR", "LOGS_DIR", "STATUS_FILE", "Cell", "CellStatus", "LocalExecutor",
           "RayExecutor", "cell_command", "cell_state", "default_jobs", "read_status", "run_cells",
           "run_process", "unfinished"]

RUNS_DIR = "runs"
LOGS_DIR = "logs"
STATUS_FILE = "status.json"
TAIL_LINES = 15
POLL_S = 2.0  # seconds between reads of the running cells' metrics files

#: Environment of every cell process: one thread, unbuffered output, no tokenizer pools.
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
             "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}


@dataclass(frozen=True)
class Cell:
    """A variant run with one seed, and where its files live in the study folder."""

    variant: Variant
    seed: int
    folder: Path

    @property
    def name(self) -> str:
        return f"{self.variant.name}-s{self.seed}"

    @property
    def run_dir(self) -> Path:
        return self.folder / RUNS_DIR / self.name

    @property
    def log(self) -> Path:
        return self.folder / LOGS_DIR / f"{self.name}.log"

    @property
    def spec(self) -> Path:
        return self.folder / CELLS_DIR / f"{self.variant.name}.rl"


@dataclass
class CellStatus:
    """What happened to a cell (saved in ``status.json``; the report reads it)."""

    variant: str
    seed: int
    status: str = "pending"  # pending running done failed invalid interrupted
    action: str = ""         # this invocation: run, resume, skip, restart
    step: int = 0            # steps in metrics.jsonl
    returncode: int | None = None
    seconds: float | None = None
    error: str = ""          # the spec error, or the tail of the failed process's output
    acc: float | None = None  # newest held-out greedy accuracy seen
    started: float | None = field(default=None, repr=False)


# ----------------------------------------------------------------------------- one cell

def _last_steps(path: Path) -> tuple[int, float | None]:
    """(last step, last held-out greedy accuracy) of a metrics file; (0, None) without one.
    The file may be mid-write (a running cell): a cut line is skipped silently."""
    if not path.is_file():
        return 0, None
    records = read_metrics(path, warn_unreadable=False)
    accs = [r[GREEDY_ACC] for r in records if isinstance(r.get(GREEDY_ACC), (int, float))]
    return (records[-1]["step"] if records else 0), (float(accs[-1]) if accs else None)


def cell_state(run_dir: Path, steps: int, save_final: bool = True) -> tuple[str, int]:
    """What to do with a cell's run folder: ``new``, ``done``, ``resume`` or ``restart``,
    and the steps its metrics reach."""
    if not run_dir.exists():
        return "new", 0
    if not run_dir.is_dir():
        return "new", 0  # `rldsl run` will say what is in the way
    done_steps, _ = _last_steps(run_dir / METRICS_FILE)
    ckpt = latest_checkpoint(run_dir)
    ckpt_step = int(ckpt.name.split("-")[1]) if ckpt is not None else None
    if done_steps >= steps and (not save_final or (ckpt_step is not None and ckpt_step >= steps)):
        return "done", done_steps
    if ckpt is not None:
        return "resume", done_steps
    return "restart", done_steps


def cell_command(cell: Cell, study: Study, action: str) -> list[str]:
    """The ``rldsl run`` command line of a cell (``action``: new/restart or resume)."""
    cli = [sys.executable, "-m", "rldsl.cli", "run"]
    if action == "resume":
        return cli + ["--resume", str(cell.run_dir), "--steps", str(study.steps)]
    argv = cli + [str(cell.spec), "--out", str(cell.run_dir), "--seed", str(cell.seed),
                  "--steps", str(study.steps)]
    for item in study.sets:
        argv += ["--set", item]
    return argv


_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()


def _stop(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM (the run saves a checkpoint and exits), then SIGKILL after ``grace`` s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_process(argv: Sequence[str], log_path: str, env: dict[str, str], cwd: str) -> int:
    """Run one cell's command with its output appended to ``log_path``; return the exit code.

    The process gets its own session, so a Ctrl-C at the terminal reaches the study, which
    then stops its cells with SIGTERM (each saves a checkpoint). An interrupt of this call
    (a Ray task cancelled) stops the process the same way.
    """
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n$ {shlex.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                env={**os.environ, **env}, start_new_session=True)
        with _RUNNING_LOCK:
            _RUNNING.add(proc)
        try:
            return proc.wait()
        except BaseException:
            _stop(proc)
            raise
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(proc)


# ----------------------------------------------------------------------------- executors

def default_jobs() -> int:
    """The machine's cores (those this process may use)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class LocalExecutor:
    """Cells as child processes of this machine, ``jobs`` at a time."""

    def __init__(self, jobs: int):
        self.jobs = jobs
        self._pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="cell")

    def submit(self, argv: list[str], log: Path, env: dict[str, str], cwd: str) -> Future:
        return self._pool.submit(run_process, argv, str(log), env, cwd)

    def stop(self) -> None:
        """Stop every running cell (each saves a checkpoint)."""
        with _RUNNING_LOCK:
            procs = list(_RUNNING)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class RayExecutor:
    """Cells as Ray tasks (one CPU each) that call :func:`run_process` on their node."""

    def __init__(self, address: str, jobs: int | None):
        try:
            import ray
        except ImportError as exc:
            raise RuntimeError("--ray-address needs Ray: pip install 'rldsl[ray]'") from exc
        self._ray = ray
        self._started = not ray.is_initialized()
        if self._started:
            import logging
            local = {"_node_ip_address": "127.0.0.1"} if address == "local" else {}
            ray.init(address=address, log_to_driver=False, include_dashboard=False,
                     logging_level=logging.WARNING, **local)
        self._task = ray.remote(num_cpus=1, max_retries=0)(run_process)
        self._refs: list[Any] = []
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.jobs = jobs or max(1, cpus)

    def submit(self, argv: list[str], log: Path, env: dict[str, str], cwd: str) -> Future:
        ref = self._task.remote(argv, str(log), env, cwd)
        self._refs.append(ref)
        return ref.future()

    def stop(self) -> None:
        for ref in self._refs:
            self._ray.cancel(ref)  # KeyboardInterrupt in the task: run_process stops its cell

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()


# ----------------------------------------------------------------------------- status file

def read_status(folder: Path) -> dict[str, CellStatus]:
    """The saved statuses of a study's cells, by cell name."""
    path = folder / STATUS_FILE
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    fields = CellStatus.__dataclass_fields__
    return {name: CellStatus(**{k: v for k, v in entry.items() if k in fields})
            for name, entry in data.get("cells", {}).items()}


def _write_status(folder: Path, statuses: dict[str, CellStatus]) -> None:
    data = {"cells": {name: {k: v for k, v in asdict(s).items() if k != "started"}
                      for name, s in statuses.items()}}
    tmp = folder / f".{STATUS_FILE}.tmp"
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, folder / STATUS_FILE)


def _tail(path: Path, start: int, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` non-empty lines written to ``path`` after byte ``start``."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    kept = [line.rstrip() for line in text.splitlines() if line.strip() and not line.startswith("$ ")]
    return "\n".join(kept[-lines:])


# ----------------------------------------------------------------------------- the study

Notify = Callable[[Cell, CellStatus, str], None]


def run_cells(cells: Sequence[Cell], study: Study, executor: Any, *, save_final: bool = True,
              notify: Notify = lambda cell, status, event: None,
              refresh: Callable[[], None] = lambda: None,
              statuses: dict[str, CellStatus] | None = None) -> dict[str, CellStatus]:
    """Run (or skip, or resume) every cell; return their statuses, also saved in status.json.

    ``notify(cell, status, event)`` is called on ``start`` and ``end`` of each cell;
    ``refresh()`` about twice a second (the live table). A cell that fails is recorded
    with the tail of its output; the others go on. On KeyboardInterrupt the running cells
    are stopped (each saves a checkpoint), recorded as interrupted, and the interrupt is
    raised again.
    """
    folder = cells[0].folder if cells else None
    statuses = statuses if statuses is not None else {}
    queue: deque[tuple[Cell, str]] = deque()
    for cell in cells:
        st = CellStatus(variant=cell.variant.name, seed=cell.seed)
        statuses[cell.name] = st
        if cell.variant.error is not None:
            st.status, st.action, st.error = "invalid", "skip", cell.variant.error
            continue
        action, st.step = cell_state(cell.run_dir, study.steps, save_final)
        _, st.acc = _last_steps(cell.run_dir / METRICS_FILE)
        if action == "done":
            st.status, st.action = "done", "skip"
            continue
        st.action = {"new": "run", "resume": "resume", "restart": "restart"}[action]
        queue.append((cell, action))
    for cell in cells:  # the finished and the invalid, first
        st = statuses[cell.name]
        if st.status in ("done", "invalid"):
            notify(cell, st, "end")
    if folder is not None:
        _write_status(folder, statuses)

    running: dict[Future, tuple[Cell, int]] = {}

    def start(cell: Cell, action: str) -> None:
        st = statuses[cell.name]
        if action == "restart":  # a run killed before its first checkpoint: start it over
            shutil.rmtree(cell.run_dir)
            st.step = 0
        cell.log.parent.mkdir(parents=True, exist_ok=True)
        offset = cell.log.stat().st_size if cell.log.exists() else 0
        argv = cell_command(cell, study, "resume" if action == "resume" else "new")
        st.status, st.started, st.error, st.returncode = "running", time.time(), "", None
        running[executor.submit(argv, cell.log, dict(CHILD_ENV), os.getcwd())] = (cell, offset)
        notify(cell, st, "start")

    def finish(fut: Future) -> None:
        cell, offset = running.pop(fut)
        st = statuses[cell.name]
        try:
            rc = fut.result()
        except BaseException as exc:  # noqa: BLE001 - a Ray task that died: reported
            rc, st.error = -1, f"{type(exc).__name__}: {exc}"
        st.returncode = rc
        st.seconds = round(time.time() - (st.started or time.time()), 1)
        st.step, st.acc = _last_steps(cell.run_dir / METRICS_FILE)
        if rc == 0:
            st.status = "done"
        else:
            st.status = "interrupted" if rc in (130, -signal.SIGTERM) else "failed"
            st.error = st.error or _tail(cell.log, offset) or f"exit code {rc}"
        _write_status(cell.folder, statuses)
        notify(cell, st, "end")

    polled = 0.0
    try:
        while queue or running:
            while queue and len(running) < executor.jobs:
                start(*queue.popleft())
            done, _ = wait(list(running), timeout=0.5, return_when=FIRST_COMPLETED)
            for fut in done:
                finish(fut)
            if time.monotonic() - polled >= POLL_S:  # progress of the running cells
                polled = time.monotonic()
                for cell, _ in running.values():
                    st = statuses[cell.name]
                    st.step, acc = _last_steps(cell.run_dir / METRICS_FILE)
                    st.acc = acc if acc is not None else st.acc
            refresh()
    except KeyboardInterrupt:
        executor.stop()
        for fut in list(running):
            try:
                fut.result(timeout=120)
            except BaseException:  # noqa: BLE001 - stopped or cancelled: recorded below
                pass
            cell, offset = running.pop(fut)
            st = statuses[cell.name]
            st.status, st.returncode = "interrupted", None
            st.seconds = round(time.time() - (st.started or time.time()), 1)
            st.step, st.acc = _last_steps(cell.run_dir / METRICS_FILE)
            notify(cell, st, "end")
        if folder is not None:
            _write_status(folder, statuses)
        raise
    return statuses


def unfinished(statuses: Iterable[CellStatus]) -> int:
    """How many cells did not finish (failed, invalid or interrupted)."""
    return sum(s.status != "done" for s in statuses)
