"""``rldsl run``: the training loop around the step (evaluation, checkpoints, resume, Ctrl-C).

One step, data flowing one way (run/step.py)::

    prompts -> rollouts.generate (G per prompt, scored by the reward) -> [dynamic sampling rounds]
            -> trainers.estimate (old/ref logprobs, the spec's shaping, filters, advantages)
            -> trainers.update (minibatches, compiled loss) -> weight sync -> metrics, checkpoint

The step talks to the two sides of a :class:`~rldsl.runtime.run.state.Run` only, so it is the
same in one process and on Ray. Every rule it carries out (dynamic sampling, the pass-rate
cap) is the compiled algorithm's. Exact resume: sampling seeds come from (seed, step, round)
(rng.py); the prompt position, optimizer, scheduler, RNG states and the algorithm's own
state are restored from the checkpoint (run/checkpointing.py).

The rooms of a run: run/folder.py (a new or a resumed run folder, its logger), run/plan.py and
run/build.py (the run planned, then built), run/schedule.py (the steps from the first to a stop),
run/step_batch.py (the step's batch, now or ahead by the producer), run/step.py (one step),
run/step_record.py (its metrics and samples), run/eval_step.py (the evaluations),
run/checkpointing.py (save, restore), this module (the run, start to end).
"""
from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..config import RunConfig
from ..errors import WorkerError
from .folder import open_logger, open_run, resume_hint
from .plan import optimizer_note


def build(plan: Any, run_dir: Path) -> Any:
    """run/build.py's :func:`~rldsl.runtime.run.build.build`, imported once a run is planned:
    this module (what ``rldsl run`` imports) imports no torch, so every check that needs no
    weights (run/plan.py) runs before torch and transformers load."""
    from .build import build as build_run

    return build_run(plan, run_dir)


# ----------------------------------------------------------------------------- the run

@contextmanager
def _interrupt_guard() -> Iterator[dict[str, bool]]:
    """Ctrl-C (SIGINT) and SIGTERM stop the run at the end of the step in hand, which is then
    checkpointed (``flag["hit"]``, read by the loop between steps). A run's state is whole only
    between steps: mid-step, an update may be half applied, the data position moved on, an
    asynchronous batch taken from its queue. A second signal raises KeyboardInterrupt at once
    and nothing is saved (the newest checkpoint on disk is complete). A SIGINT that the process
    was started ignoring (a background job of a shell script) stays ignored."""
    flag = {"hit": False}

    def handler(signum: int, frame: Any) -> None:
        if flag["hit"]:
            raise KeyboardInterrupt
        flag["hit"] = True
        os.write(2, b"\nstopping at the end of this step to save a checkpoint "
                    b"(signal again to stop at once, without one)\n")

    old: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        current = signal.getsignal(sig)
        if current == signal.SIG_IGN:
            continue
        try:
            signal.signal(sig, handler)
        except ValueError:  # not the main thread: signals stay as they are
            break
        old[sig] = current
    try:
        yield flag
    finally:
        for sig, current in old.items():
            signal.signal(sig, current)


def train(spec: str, cfg: RunConfig | None = None, resume: str | Path | None = None,
          stop_after: int | None = None, restart: bool = False) -> Path:
    """Run (or resume) training; returns the run folder.

    ``stop_after``: stop (with a checkpoint) once this many steps are done in total — used by
    tests to interrupt a run at a known point. ``resume``: continue that run folder from its
    newest whole checkpoint (a damaged newer one is passed over, saying so, and set aside); a
    folder with none (the run was killed before its first one) starts again from step 0 with its
    saved config; one whose every checkpoint is damaged is refused (RunError), untouched.
    ``restart`` (with ``resume``): start that folder again from step 0 whatever it holds (its
    records and checkpoints moved to ``previous/N/``).
    Ctrl-C / SIGTERM: see :func:`_interrupt_guard`.
    """
    opened = open_run(spec, cfg, resume, restart=restart)  # every check before a model loads (run/plan.py)
    run_dir, cfg = opened.run_dir, opened.plan.cfg
    s = build(opened.plan, run_dir)
    from .checkpointing import restore  # torch: imported by build() already
    from .schedule import run_steps, stop_quietly
    failed = True
    try:
        start = restore(s, opened.resume_from) if opened.resume_from is not None else 0
        logger = open_logger(cfg, run_dir, start, opened.resumed)
        s.warn = lambda msg: logger.print(msg, markup=False)
        for w in s.warnings:  # legal but almost surely a slip (checked before the models loaded)
            logger.print(w.render(), markup=False, soft_wrap=True)
        for note in opened.notes + s.notes:  # what the run resolved: the reward, a clipped budget, ...
            logger.print(note, markup=False, soft_wrap=True)
        with logger, _interrupt_guard() as stop:
            if start == 0:
                logger.print(optimizer_note(cfg), markup=False)
            run_steps(s, logger, stop, start, resumed=opened.resumed, stop_after=stop_after)
            logger.print_summary()
        failed = False
    except WorkerError as exc:  # an actor died or timed out: the checkpoints on disk are complete
        raise WorkerError(f"{exc}\n{resume_hint(run_dir)}") from None
    finally:
        stop_quietly(s.close, quiet=failed)  # the workers
    return run_dir
