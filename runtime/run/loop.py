"""``rldsl run``: the training loop around the step (evaluation, checkpoints, resume, Ctrl-C).

One step, data flowing one way (run/step.py)::

    prompts -> rollouts.generate (G per prompt, scored by the reward) -> [dynamic sampling rounds]
            -> trainers.estimate (old/ref logprobs, the spec's shaping, filters, advantages)
            -> trainers.update (minibatches, compiled loss) -> weight sync -> metrics, checkpoint

The step talks to the two sides of a :class:`~rldsl.runtime.run.build.Run` only, so it is the
same in one process and on Ray. Every rule it carries out (dynamic sampling, the pass-rate
cap) is the compiled algorithm's. Exact resume: sampling seeds come from (seed, step, round)
(rng.py); the prompt position, optimizer, scheduler, RNG states and the algorithm's own
state are restored from the checkpoint (run/checkpointing.py).

The rooms of a run: run/rollouts.py (the step's batch, now or ahead by the producer),
run/step.py (one step), run/record.py (its metrics and samples), run/eval_step.py (the
evaluations), run/checkpointing.py (save, restore), this module (the loop).
"""
from __future__ import annotations

import math
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .. import faults
from ..batch import StepRollout
from ..config import MODEL_RUN_DEFAULTS, RunConfig
from ..errors import RewardError, RunError, WorkerError
from ..records import checkpoint as ckpt
from ..records.metrics import REWARD, MetricsLogger
from ..records.run_dir import (METRICS_FILE, SPEC_FILE, load_run_config, run_dir_of, save_config,
                               save_parent_specs)
from ..records.trackers import open_trackers
from ..rollout.producer import RolloutProducer
from .build import Run, build, load_spec, plan_run
from .checkpointing import restore, save, start_again
from .eval_step import evaluate, evaluate_current
from .rollouts import checked, start_producer
from .step import train_step


# ----------------------------------------------------------------------------- the run

def optimizer_note(cfg: RunConfig) -> str:
    """The run-start line naming the optimizer settings and where their defaults come from."""
    t = cfg.train
    note = f"optimizer: AdamW lr {t.lr:g}, betas ({t.betas[0]:g}, {t.betas[1]:g})"
    if cfg.model.path is None:
        return note + " (the toy's tuned defaults)"
    if t.lr == MODEL_RUN_DEFAULTS["train.lr"] and tuple(t.betas) == MODEL_RUN_DEFAULTS["train.betas"]:
        return note + " (defaults for a user's model, as TRL and verl; set train.lr / train.betas to change)"
    return note


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


def _shut_down(producer: RolloutProducer[StepRollout] | None, s: Run, quiet: bool) -> None:
    """Stop the producer and the run's workers. ``quiet`` (an error is on its way out): an error
    while stopping is printed, never raised, so it cannot hide the one that stopped the run."""
    first: BaseException | None = None
    for stop in ([producer.close] if producer is not None else []) + [s.close]:
        try:
            stop()
        except Exception as exc:  # noqa: BLE001 - reported below
            if quiet:
                print(f"while stopping the run: {type(exc).__name__}: {exc}", file=sys.stderr)
            first = first or exc
    if first is not None and not quiet:
        raise first


def train(spec: str, cfg: RunConfig | None = None, resume: str | Path | None = None,
          stop_after: int | None = None) -> Path:
    """Run (or resume) training; returns the run folder.

    ``stop_after``: stop (with a checkpoint) once this many steps are done in total — used by
    tests to interrupt a run at a known point. ``resume``: continue that run folder from its
    newest whole checkpoint (a damaged newer one is passed over, saying so); a folder with none
    (the run was killed before its first one) starts again from step 0 with its saved config.
    Ctrl-C / SIGTERM: see :func:`_interrupt_guard`.
    """
    if resume is not None:
        run_dir = Path(resume)
        if not run_dir.is_dir():
            raise RunError(f"no run folder {run_dir} to resume")
        saved = load_run_config(run_dir)
        spec_file = run_dir / SPEC_FILE
        plan = checked(plan_run(load_spec(str(spec_file), spec_file.read_text(encoding="utf-8")),
                                saved if cfg is None else cfg))
        if plan.cfg != saved:
            save_config(plan.cfg, run_dir)  # config.json shows what actually runs
        start = None
        resume_from, notes = ckpt.newest_loadable(run_dir)
        if resume_from is None:
            notes += start_again(run_dir)
            start, resume = 0, None
    else:
        cfg = cfg or RunConfig()
        algo = load_spec(spec)  # the one parse of the run
        run_dir = run_dir_of(cfg, algo.name)
        if (run_dir / METRICS_FILE).exists() or ckpt.latest_checkpoint(run_dir) is not None:
            raise RunError(f"{run_dir} already holds a run: resume it with `rldsl run --resume {run_dir}` "
                           f"or choose another --out")
        plan = checked(plan_run(algo, cfg))  # every check before a model loads
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(plan.cfg, run_dir, algo.source)  # the resolved config: what runs
        save_parent_specs(run_dir, algo.parent_sources)
        start, notes = 0, []
    cfg = plan.cfg
    s = build(plan, run_dir)
    producer: RolloutProducer[StepRollout] | None = None
    failed = True
    try:
        if start is None:
            start = restore(s, resume_from)
        total = cfg.train.steps
        resume_step = start if resume is not None else None
        trackers = open_trackers(cfg.log.report_to, run_dir, config=cfg.model_dump(mode="json"),
                                 spec_text=(run_dir / SPEC_FILE).read_text(encoding="utf-8"),
                                 project=cfg.log.project, resume_step=resume_step)
        logger = MetricsLogger(run_dir, tensorboard=cfg.log.tensorboard, total_steps=total,
                               progress=cfg.log.progress, print_every=cfg.log.every,
                               resume_step=resume_step, trackers=trackers)
        step = start
        last_saved = start if resume is not None else -1
        s.warn = lambda msg: logger.print(msg, markup=False)
        for w in s.warnings:  # legal but almost surely a slip (checked before the models loaded)
            logger.print(w.render(), markup=False, soft_wrap=True)
        for note in notes + s.notes:  # what the run resolved: the reward, a clipped budget, ...
            logger.print(note, markup=False, soft_wrap=True)
        in_step = False  # between two steps, the only place the run's state is whole
        with logger, _interrupt_guard() as stop:
            try:
                if start == 0:
                    logger.print(optimizer_note(cfg), markup=False)
                    if cfg.eval.every:  # 0: no evaluation at all
                        logger.log(0, evaluate(s, 0))
                producer = start_producer(s, start, total)
                unscored_steps = 0  # steps in a row whose every reward failed (reward.on_error=skip)
                while step < total:
                    if stop_after is not None and step >= stop_after:
                        break
                    if stop["hit"]:  # Ctrl-C or SIGTERM during the last step: saved below
                        raise KeyboardInterrupt
                    in_step = True
                    m = train_step(s, step, producer)
                    step += 1
                    if cfg.eval.every and (step % cfg.eval.every == 0 or step == total):
                        m.update(evaluate_current(s, step, producer))
                    logger.log(step, m)
                    unscored_steps = unscored_steps + 1 if math.isnan(m[REWARD]) else 0
                    if cfg.reward.max_skipped_steps and unscored_steps >= cfg.reward.max_skipped_steps:
                        raise RewardError(
                            f"the reward failed on every sample of {unscored_steps} steps in a row (steps "
                            f"{step - unscored_steps + 1}-{step}; reward.on_error=skip skipped them all): "
                            f"nothing to train on. The warnings above show each step's first failure; fix "
                            f"the reward, or raise reward.max_skipped_steps (0 = never stop)")
                    if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                        save(s, step, producer)
                        last_saved = step
                    faults.at("step", step)
                    in_step = False
                if last_saved != step and (cfg.checkpoint.save_final or step < total):
                    save(s, step, producer)
            except KeyboardInterrupt:  # `rldsl run` names the command that resumes it (runtime/cli.py)
                if in_step:  # a second signal, mid-step: nothing whole to save
                    logger.print(f"stopped during step {step + 1} without saving it")
                    raise
                if last_saved != step:
                    save(s, step, producer)
                raise
            logger.print_summary()
        failed = False
    except WorkerError as exc:  # an actor died or timed out: the checkpoints on disk are complete
        last = ckpt.latest_checkpoint(run_dir)
        hint = (f"the run folder holds complete checkpoint {last.name}: continue with "
                f"`rldsl run --resume {run_dir}` (--trainers may differ)" if last is not None
                else f"no checkpoint was written yet: `rldsl run --resume {run_dir}` starts it again from step 0")
        raise WorkerError(f"{exc}\n{hint}") from None
    finally:
        _shut_down(producer, s, quiet=failed)
    return run_dir
