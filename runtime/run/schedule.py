"""The steps of a run, from its first to its last or to a stop: each step (run/step.py), the
evaluations when due (run/eval_step.py), the metrics logged, the checkpoints when due and at the
end (run/checkpointing.py), and a stop (Ctrl-C, SIGTERM, ``stop_after``) checkpointed between
two steps. An asynchronous run's producer lives here, from before the first step to the last.
"""
from __future__ import annotations

import math
import sys
from typing import Callable

from .. import faults
from ..errors import NothingTrained, RewardError
from ..records.metrics import LOSS_SCALE, OPTIMIZER_STEPS, REWARD, SKIPPED_STEPS, MetricsLogger
from .checkpointing import save
from .eval_step import evaluate, evaluate_current
from .step_batch import start_producer
from .state import Run, StepProducer
from .step import train_step


def run_steps(s: Run, logger: MetricsLogger, stop: dict[str, bool], start: int, *, resumed: bool,
              stop_after: int | None = None) -> None:
    """Steps ``start`` .. ``train.steps`` of ``s``, logged by ``logger``. ``stop["hit"]`` (set by
    a signal during a step: run/loop.py) stops the run once the step is done; ``stop_after``
    stops it once this many steps are done in total. A stop saves a checkpoint unless the last
    step has one; a second signal mid-step (KeyboardInterrupt) saves nothing."""
    cfg = s.cfg
    total = cfg.train.steps
    step = start
    last_saved = start if resumed else -1
    in_step = False  # between two steps, the only place the run's state is whole
    producer: StepProducer | None = None
    failed = True
    try:
        if start == 0 and cfg.eval.every:  # 0: no evaluation at all
            logger.log(0, evaluate(s, 0))
        producer = start_producer(s, start, total)
        unscored_steps = 0  # steps in a row whose every reward failed (reward.on_error=skip)
        overflowed = 0  # steps whose every update overflowed in float16 (train/loss_scale.py)
        m: dict[str, float] = {}
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
            if overflowed_step(m):  # said at once, as DeepSpeed's and apex's loss scalers do
                overflowed += 1
                logger.print(f"warning: step {step} trained nothing: float16, every update's scaled gradient "
                             f"overflowed and was skipped (loss scale now {m.get(LOSS_SCALE, math.nan):g})",
                             markup=False)
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
        report_overflow(logger, overflowed, step - start, m.get(LOSS_SCALE))
        failed = False
    except KeyboardInterrupt:  # `rldsl run` names the command that resumes it (runtime/cli.py)
        if in_step:  # a second signal, mid-step: nothing whole to save
            logger.print(f"stopped during step {step + 1} without saving it")
            raise
        if last_saved != step:
            save(s, step, producer)
        raise
    finally:
        if producer is not None:
            stop_quietly(producer.close, quiet=failed)


def overflowed_step(m: dict[str, float]) -> bool:
    """Whether a step trained nothing because each of its updates overflowed: a float16 run's step
    (``train/skipped_steps``, the loss scaler's count) with no optimizer step."""
    return m.get(SKIPPED_STEPS, 0.0) > 0 and m.get(OPTIMIZER_STEPS, 1.0) == 0


def report_overflow(logger: MetricsLogger, overflowed: int, steps: int, scale: float | None) -> None:
    """The end of a float16 run that had steps whose every update overflowed (skipped, the loss
    scale halved each time; train/loss_scale.py; each said when it happened): a warning with the
    count, never silence; a run in which *every* step did (``overflowed == steps``) trained
    nothing, and ends with :class:`~rldsl.runtime.errors.NothingTrained` (exit 1) after its records
    and checkpoint are written -- exit 0 would tell a script the model was trained."""
    if overflowed == 0:
        return
    where = f"; the loss scale backed off to {scale:g}" if scale is not None else ""
    what = (f"float16: every update's scaled gradient overflowed (inf/nan) and was skipped{where} "
            "(train/skipped_steps, train/loss_scale)")
    if overflowed < steps:
        logger.print(f"warning: {overflowed} of {steps} steps trained nothing -- {what}", markup=False)
        return
    raise NothingTrained(f"the run trained nothing: in each of its {steps} step(s) {what}. The model's "
                         "float16 forward or backward overflows: train in model.dtype=bfloat16 (or float32)")


def stop_quietly(close: Callable[[], None], quiet: bool) -> None:
    """Stop something of the run (``close()``: the producer, the workers). ``quiet`` (an error is
    on its way out): an error while stopping is printed, never raised, so it cannot hide the one
    that stopped the run."""
    try:
        close()
    except Exception as exc:  # noqa: BLE001 - reported
        if not quiet:
            raise
        print(f"while stopping the run: {type(exc).__name__}: {exc}", file=sys.stderr)
