"""Fault injection points: a run holds, is interrupted or kills itself at a named phase of a step.

For tests of what a run survives (tests/faults/), never for users. A fault is set by the
environment of the run's processes (Ray actors inherit it)::

    RLDSL_FAULT="<phase>@<step>:<action>[,<phase>@<step>:<action>...]"

``phase``, where in the run the point sits (each one is passed by every run that has it):

    generate    a batch's prompts drawn, its samples about to be generated (an asynchronous run's
                producer thread)
    score       a batch generated, about to be scored (asynchronous runs that score in a stage
                of their own; elsewhere scoring is part of ``generate``)
    update      the trainer's update, before the optimizer steps
    sync        the weight sync (or an asynchronous run's publication) after the update
    sync_bucket the collective weight sync (distributed.weight_sync = "collective") in a rollout
                worker's process, its first bucket loaded and the next not yet received (step N:
                the sync after step N's update); Ray actors are given the driver's RLDSL_FAULT*
                variables when they start
    checkpoint  a checkpoint write: every file written, the folder not yet renamed
    step        between two steps: the step's metrics logged, before the next one starts

Every point but ``sync_bucket`` is in the driver process; to fault a Ray actor there, hold the run
and kill the actor.

``step``: the step being worked on, 1-based as metrics.jsonl numbers them (the batch of step
N; checkpoint ``step-N``; ``step@N`` is right after step N). ``action``:

    kill        SIGKILL the process at that point (no handler runs, nothing is flushed)
    interrupt   SIGINT to the process (what Ctrl-C sends), then carry on
    hold        create the file named by ``RLDSL_FAULT_HELD`` and wait there while it exists:
                the test sees the file and injects its own fault (kills the process group,
                a Ray worker, the reward server) with the run held at a known point, no
                sleep raced, then removes the file to let the run go on (if it still can)

``RLDSL_FAULT_ONCE=<file>``: each fault fires once across every process and restart (the first
to create ``<file>.<n>`` fires it); without it, a fault fires whenever its point is passed
(a restarted Ray actor that redoes the step kills itself again).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

FAULT = "RLDSL_FAULT"
HELD = "RLDSL_FAULT_HELD"
ONCE = "RLDSL_FAULT_ONCE"
PHASES = ("generate", "score", "update", "sync", "sync_bucket", "checkpoint", "step")
ACTIONS = ("kill", "interrupt", "hold")


@dataclass(frozen=True)
class Fault:
    index: int
    phase: str
    step: int
    action: str


def parse(text: str) -> list[Fault]:
    """The faults of a ``RLDSL_FAULT`` value; a malformed one raises ValueError naming it."""
    out = []
    for i, part in enumerate(p.strip() for p in text.split(",") if p.strip()):
        try:
            where, action = part.split(":")
            phase, step = where.split("@")
            fault = Fault(i, phase, int(step), action)
        except ValueError:
            raise ValueError(f"{FAULT}: {part!r} is not <phase>@<step>:<action>") from None
        if fault.phase not in PHASES or fault.action not in ACTIONS:
            raise ValueError(f"{FAULT}: {part!r}: the phase is one of {', '.join(PHASES)}, "
                             f"the action one of {', '.join(ACTIONS)}")
        out.append(fault)
    return out


def at(phase: str, step: int) -> None:
    """An injection point: ``phase`` of step ``step`` (1-based). Does nothing unless
    ``RLDSL_FAULT`` names this point."""
    text = os.environ.get(FAULT)
    if not text:
        return
    for fault in parse(text):
        if fault.phase == phase and fault.step == step and _first(fault):
            _fire(fault)


def _first(fault: Fault) -> bool:
    once = os.environ.get(ONCE)
    if not once:
        return True
    try:
        os.close(os.open(f"{once}.{fault.index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _fire(fault: Fault) -> None:
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "interrupt":
        os.kill(os.getpid(), signal.SIGINT)
    else:
        held = os.environ.get(HELD)
        if not held:
            raise ValueError(f"{FAULT}: the hold at {fault.phase}@{fault.step} needs {HELD}=<file>")
        with open(held, "w", encoding="utf-8") as f:
            f.write(f"{fault.phase}@{fault.step} {os.getpid()}\n")
        while os.path.exists(held):  # until the test removes it (or kills this process)
            time.sleep(0.05)
