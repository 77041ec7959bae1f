"""SIGKILL (and Ctrl-C) of a whole run at each phase of a step, then `rldsl run --resume`:
every step logged exactly once, the step counter continuing, no sample record lost, and for a
deterministic run (one process) the weights of the uninterrupted run, bit for bit."""
from __future__ import annotations

from pathlib import Path

from rldsl.runtime.records.checkpoint import latest_checkpoint

from fault_helpers import (assert_same_weights, final_weights, rldsl, run_args, samples_of,
                           step_numbers, steps_of)

KILLED = -9        # the return code of a process ended by SIGKILL
INTERRUPTED = 130  # `rldsl run` stopped by Ctrl-C
K1 = ("rollout.max_staleness=1",)
PARTIAL = ("rollout.max_staleness=1", "rollout.partial=true", "rollout.partial_tokens=2",
           "rollout.max_new_tokens=6")


def faulted_then_resumed(run: Path, first: list[str], faults: list[tuple[str, int]]) -> list[str]:
    """Start the run, then resume it, once per fault (``RLDSL_FAULT`` value, expected exit
    code); finally resume it to the end. Returns each process's output."""
    outputs = []
    args = first
    for fault, code in faults:
        res = rldsl(args, fault=fault)
        assert res.returncode == code, (fault, res.returncode, res.stderr[-3000:])
        outputs.append(res.stdout + res.stderr)
        args = ["run", "--resume", str(run)]
    res = rldsl(args)
    assert res.returncode == 0, res.stderr[-3000:]
    outputs.append(res.stdout + res.stderr)
    return outputs


def assert_whole(run: Path, ref: Path) -> None:
    assert step_numbers(run) == [1, 2, 3, 4, 5, 6]  # each step once, the counter continuing
    assert steps_of(run) == steps_of(ref)
    assert samples_of(run) == samples_of(ref)  # no sample record lost or doubled


def test_a_run_killed_before_its_first_checkpoint_resumes_from_step_0(model_dir, reference, tmp_path):
    run = tmp_path / "run"
    res = rldsl(run_args(model_dir, run, "checkpoint.every=4"), fault="update@2:kill")
    assert res.returncode == KILLED
    assert latest_checkpoint(run) is None and step_numbers(run) == [1]
    res = rldsl(["run", "--resume", str(run)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "holds no complete checkpoint" in res.stdout and "starting it again from step 0" in res.stdout
    assert f"the earlier attempt's records are kept in {run / 'previous' / '1'}" in res.stdout
    assert step_numbers(run / "previous" / "1") == [1]  # the killed attempt's records: kept, not deleted
    ref = reference()
    assert_whole(run, ref)
    assert_same_weights(final_weights(run), final_weights(ref))


def test_one_process_run_killed_at_every_phase_ends_with_the_uninterrupted_weights(model_dir, reference, tmp_path):
    """K = 0, one process: Ctrl-C mid-update, then SIGKILLs in generation, weight sync, a
    checkpoint write and between steps; the final weights equal the uninterrupted run's."""
    run = tmp_path / "run"
    out = faulted_then_resumed(run, run_args(model_dir, run), [
        ("update@2:interrupt", INTERRUPTED), ("generate@3:kill", KILLED), ("sync@4:kill", KILLED),
        ("checkpoint@5:kill", KILLED), ("step@5:kill", KILLED)])
    assert "continue from checkpoint step-2" in out[0]  # the step in hand was finished and saved
    ref = reference()
    assert_whole(run, ref)
    assert_same_weights(final_weights(run), final_weights(ref))


def test_async_run_killed_at_every_phase_continues_exactly(model_dir, reference, tmp_path):
    """rollout.max_staleness=1: killed while the producer generates and scores ahead, in the
    update and mid-checkpoint, then Ctrl-C mid-update (once: "the rollout producer produced the
    batch of step 4, expected 3" on --resume); the batches in flight at a checkpoint are restored
    from it."""
    run = tmp_path / "run"
    out = faulted_then_resumed(run, run_args(model_dir, run, *K1), [
        ("generate@3:kill", KILLED), ("score@4:kill", KILLED), ("update@4:kill", KILLED),
        ("checkpoint@5:kill", KILLED), ("update@5:interrupt", INTERRUPTED)])
    assert "continue from checkpoint step-5" in out[4]  # the step in hand was finished and saved
    ref = reference(*K1)
    assert_whole(run, ref)
    assert_same_weights(final_weights(run), final_weights(ref))


def test_a_partial_run_killed_at_every_phase_resumes(model_dir, tmp_path):
    """rollout.partial: killed while a batch is generated in segments (newer weights loaded
    between two), while one is scored and mid-checkpoint, then Ctrl-C mid-update; each resume
    regenerates what was in flight (a partial run's schedule depends on timing: its numbers are
    not the uninterrupted run's, its steps and samples are whole)."""
    run = tmp_path / "run"
    out = faulted_then_resumed(run, run_args(model_dir, run, *PARTIAL), [
        ("generate@3:kill", KILLED), ("score@4:kill", KILLED), ("checkpoint@4:kill", KILLED),
        ("update@5:interrupt", INTERRUPTED)])
    assert "continue from checkpoint step-5" in out[3]
    assert step_numbers(run) == [1, 2, 3, 4, 5, 6]
    recs = steps_of(run)
    assert all(r["async/staleness_max"] <= 1 for r in recs)
    assert sorted({s["step"] for s in samples_of(run)}) == [1, 2, 3, 4, 5, 6]
