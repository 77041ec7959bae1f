"""The run folder: every file name in it, atomic writes, and the config and spec copies.

Layout of a run folder (the names below are the only place they are spelled)::

    <run>/
        config.json        the resolved RunConfig (JSON round-trips None exactly; TOML cannot)
        spec.rl            the spec the run trains, and <parent>.rl for each spec it extends
        metrics.jsonl      one JSON object per step (metrics.py)
        samples.jsonl      the sampled completions and their rewards (samples.py)
        tb/                TensorBoard events (log.tensorboard, or "tensorboard" in log.report_to)
        trackers.json      the run ids of log.report_to's trackers, so a resume continues them
        wandb/, mlruns/    W&B's local files and MLflow's default file store (log.report_to)
        curves.png         ``rldsl plot`` output for one run
        checkpoints/       see checkpoint.py
            step-N/  policy/  critic/  optimizer.pt  state.pt  COMPLETE
            latest
            damaged-step-N/  a checkpoint found damaged at a resume: set aside, never deleted
        previous/N/        what an earlier attempt left when the run started again from step 0
                           (killed before its first checkpoint, or --restart): its metrics,
                           samples, checkpoints, TensorBoard events and tracker ids
"""
from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Mapping

from ..config import RunConfig, load_config
from ..errors import ConfigError

CONFIG_FILE = "config.json"
SPEC_FILE = "spec.rl"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
PREVIOUS_DIR = "previous"
TENSORBOARD_DIR = "tb"
TRACKERS_FILE = "trackers.json"  # the tracker run ids a resumed run continues (log.report_to)
CURVES_FILE = "curves.png"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
COMPLETE_MARKER = "COMPLETE"
POLICY_DIR = "policy"
CRITIC_DIR = "critic"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.pt"


# ----------------------------------------------------------------------------- atomic writes

def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (deepest first), then ``root``."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(folder))


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a crash leaves either the old or the new file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


# ----------------------------------------------------------------------------- config and spec

def keep_aside(run_dir: str | os.PathLike[str]) -> Path | None:
    """Move what a run's attempt wrote (metrics, samples, checkpoints, TensorBoard events,
    tracker ids) into ``previous/N/`` of its folder (N = 1, 2, ...), for a run that starts
    again from step 0; returns that folder, or None when there was nothing to move."""
    run_dir = Path(run_dir)
    names = [n for n in (METRICS_FILE, SAMPLES_FILE, CHECKPOINTS_DIR, TENSORBOARD_DIR, TRACKERS_FILE)
             if (run_dir / n).exists()]
    if not names:
        return None
    n = 1
    while (run_dir / PREVIOUS_DIR / str(n)).exists():
        n += 1
    kept = run_dir / PREVIOUS_DIR / str(n)
    kept.mkdir(parents=True)
    for name in names:
        os.replace(run_dir / name, kept / name)
    fsync_dir(kept)
    fsync_dir(run_dir)
    return kept


def save_config(cfg: RunConfig, run_dir: str | os.PathLike[str], spec_text: str | None = None) -> Path:
    """Write ``<run_dir>/config.json`` (exact round-trip) and ``<run_dir>/spec.rl``.

    ``spec_text`` is the source of the spec the run trains (None writes no spec file).
    Returns the config path. Both files are written atomically.
    """
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    path = run / CONFIG_FILE
    write_text_atomic(path, cfg.model_dump_json(indent=2) + "\n")
    if spec_text is not None:
        write_text_atomic(run / SPEC_FILE, spec_text)
    return path


def save_parent_specs(run_dir: Path, sources: Mapping[str, str]) -> None:
    """``<name>.rl`` for every spec the run's spec extends: ``extends`` resolves next to spec.rl first."""
    for name, text in sources.items():
        write_text_atomic(run_dir / f"{name}.rl", text)


def load_run_config(run_dir: str | os.PathLike[str]) -> RunConfig:
    """The config a run was started with (``<run_dir>/config.json``), identical to the saved one."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"no {CONFIG_FILE} in {run_dir}: not a run folder")
    return load_config(path)


def default_run_dir(spec_name: str, root: str | os.PathLike[str] = "runs",
                    now: datetime | None = None) -> Path:
    """``<root>/<spec_name>-<YYYYmmdd-HHMMSS>``, with ``-2``, ``-3``... if that exists."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    stem = Path(spec_name).stem or "run"
    candidate = Path(root) / f"{stem}-{stamp}"
    k = 2
    while candidate.exists():
        candidate = Path(root) / f"{stem}-{stamp}-{k}"
        k += 1
    return candidate


def run_dir_of(cfg: RunConfig, spec_name: str, root: str | os.PathLike[str] = "runs") -> Path:
    """The run folder: ``cfg.out`` if set, else a fresh ``runs/<spec-name>-<timestamp>``."""
    return Path(cfg.out) if cfg.out is not None else default_run_dir(spec_name, root)
