"""A run's folder: a new run's created (the resolved config and the spec written before any
model loads), a stopped or killed one reopened to resume (its newest whole checkpoint, or from
step 0 when it never wrote one; refused, the folder untouched, when every checkpoint it holds
is damaged), its metrics logger and trackers opened, and the line that says how to continue
after a failure. Nothing here deletes a run's records: what a run starting again from step 0
leaves behind is moved to ``previous/N/`` in its folder.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rldsl.config_files import decode_utf8
from rldsl.out_folder import check_out_folder

from ..config import RunConfig
from ..errors import RunError
from ..records import checkpoint as ckpt
from ..records.metrics import MetricsLogger, read_metrics
from ..records.run_dir import (METRICS_FILE, SPEC_FILE, keep_aside, load_run_config, run_dir_of,
                               save_config, save_parent_specs)
from ..records.trackers import open_trackers
from .plan import load_spec, plan_run
from .state import Plan


@dataclass
class Opened:
    """A run folder opened for training. ``resume_from``: the checkpoint to restore (None: the run
    starts at step 0); ``resumed``: the run continues an earlier one (its records and trackers
    go on from the checkpoint's step); ``notes``: what opening it found, for the log."""

    plan: Plan
    run_dir: Path
    resume_from: Path | None = None
    resumed: bool = False
    notes: list[str] = field(default_factory=list)


def open_run(spec: str, cfg: RunConfig | None = None, resume: str | Path | None = None,
             restart: bool = False) -> Opened:
    """A new run of ``spec`` under ``cfg`` in the folder its config names (refused if that folder
    holds a run already), or the run folder ``resume`` reopened with its saved spec (and its
    saved config unless ``cfg`` is given). ``restart``: the reopened run starts again from step
    0 whatever its checkpoints (its records and checkpoints moved to ``previous/N/``). Every
    check runs here, before any model loads."""
    if restart and resume is None:
        raise RunError("--restart starts a run folder again from step 0: give the folder with "
                       "--resume RUN")
    if resume is not None:
        run_dir = Path(resume)
        if not run_dir.is_dir():
            raise RunError(f"no run folder {run_dir} to resume")
        saved = load_run_config(run_dir)
        if (run_dir / METRICS_FILE).is_file():  # a damaged metrics.jsonl refused before any model loads
            read_metrics(run_dir, warn_unreadable=False)
        spec_file = run_dir / SPEC_FILE
        plan = plan_run(load_spec(str(spec_file), decode_utf8(spec_file.read_bytes(), spec_file, RunError)),
                        saved if cfg is None else cfg)
        found = [] if restart else ckpt.inspect_checkpoints(run_dir)
        if found and not found[-1].resumable:
            raise RunError(all_damaged(run_dir, found))  # before anything in the folder changes
        if plan.cfg != saved:
            save_config(plan.cfg, run_dir)  # config.json shows what actually runs
        if restart:
            return Opened(plan, run_dir, None, False, start_again(run_dir, "--restart"))
        resume_from, notes = ckpt.resume_notes(found)
        if resume_from is None:
            return Opened(plan, run_dir, None, False, notes + start_again(run_dir))
        return Opened(plan, run_dir, resume_from, True, notes)
    cfg = cfg or RunConfig()
    algo = load_spec(spec)  # the one parse of the run
    run_dir = check_out_folder(run_dir_of(cfg, algo.name), RunError, empty=False)
    if (run_dir / METRICS_FILE).exists() or ckpt.latest_checkpoint(run_dir) is not None:
        raise RunError(f"{run_dir} already holds a run: resume it with `rldsl run --resume {run_dir}` "
                       f"or choose another --out")
    plan = plan_run(algo, cfg)  # every check before a model loads
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(plan.cfg, run_dir, algo.source)  # the resolved config: what runs
    save_parent_specs(run_dir, algo.parent_sources)
    return Opened(plan, run_dir)


def start_again(run_dir: Path, why: str | None = None) -> list[str]:
    """A run that starts again from step 0 with its saved config: resumed without a checkpoint
    (killed before its first one was written), or ``why`` (``--restart``). What the earlier
    attempt left (metrics, samples, checkpoints, TensorBoard events, tracker ids) is moved to
    ``previous/N/``, never deleted: the run writes its own again. Returns the lines telling the
    user so."""
    ckpt.clean_incomplete(run_dir)  # crash leftovers of a save; damaged folders are set aside
    kept = keep_aside(run_dir)
    where = f"; the earlier attempt's records are kept in {kept}" if kept is not None else ""
    if why is not None:
        return [f"{why}: {run_dir} starts again from step 0 with its saved config{where}"]
    return [f"{run_dir} holds no complete checkpoint (the run stopped before its first one was "
            f"written): starting it again from step 0 with its saved config{where}"]


def all_damaged(run_dir: Path, found: list[ckpt.Inspection]) -> str:
    """The refusal of a resume whose every checkpoint is damaged: each one, what is damaged and
    what is intact, why no part of them is resumed from, and the ways on. Nothing was changed."""
    lines = [f"{run_dir} cannot be resumed: every checkpoint it holds is damaged (nothing in the "
             f"folder was changed):"]
    for f in found:
        intact = (f" (intact: {', '.join(rel for rel in f.intact if ckpt.read_on_resume(rel))}"
                  f"{' and the tokenizer and config files' if any(not ckpt.read_on_resume(r) for r in f.intact) else ''})"
                  if f.intact else "")
        lines.append(f"  {f.path.name}: {f.problem()}{intact}")
    lines += [
        "A resume reads the weights (*.safetensors), optimizer.pt and state.pt of one checkpoint and "
        "needs each whole: without the weights nothing continues; without optimizer.pt the "
        "optimizer's moments would start again from zero, without state.pt the data position, the "
        "random state and the algorithm's state are lost, so neither would continue the run that "
        "stopped, and no part of a damaged checkpoint is resumed from. (Damage limited to the "
        "tokenizer or config files beside the weights is resumed from, exactly: a resume does not "
        "read them.)",
        f"Put back a copy of the checkpoint if one exists, or start the run over from step 0 with "
        f"its saved config: `rldsl run --resume {run_dir} --restart` (its records and checkpoints "
        f"are moved to {run_dir}/previous/N, not deleted)."]
    return "\n".join(lines)


def open_logger(cfg: RunConfig, run_dir: Path, start: int, resumed: bool) -> MetricsLogger:
    """The run's metrics logger (metrics.jsonl, TensorBoard, the progress display) with the
    trackers ``log.report_to`` names; a resumed run's go on from step ``start``."""
    resume_step = start if resumed else None
    trackers = open_trackers(cfg.log.report_to, run_dir, config=cfg.model_dump(mode="json"),
                             spec_text=(run_dir / SPEC_FILE).read_text(encoding="utf-8"),
                             project=cfg.log.project, resume_step=resume_step)
    return MetricsLogger(run_dir, tensorboard=cfg.log.tensorboard, total_steps=cfg.train.steps,
                         progress=cfg.log.progress, print_every=cfg.log.every,
                         resume_step=resume_step, trackers=trackers)


def resume_hint(run_dir: Path) -> str:
    """How to continue a run that failed (an actor died or timed out): the checkpoints on disk
    are complete."""
    last = ckpt.latest_checkpoint(run_dir)
    if last is not None:
        return (f"the run folder holds complete checkpoint {last.name}: continue with "
                f"`rldsl run --resume {run_dir}` (--trainers may differ)")
    return f"no checkpoint was written yet: `rldsl run --resume {run_dir}` starts it again from step 0"
