"""A damaged newest checkpoint (a flipped byte, a cut file, a missing file) is detected by the
checksums recorded at write and --resume falls back to the one before, saying so and keeping the
damaged one aside; a run whose only checkpoint is damaged is refused (exit 2), its folder
untouched, until ``--restart`` starts it over with its records kept; damage a resume does not
read (the tokenizer files) is resumed from, exactly; a disk that fills up during a checkpoint
write stops the run with a clear error and leaves the previous checkpoint loadable."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rldsl.runtime.records import checkpoint as ckpt
from rldsl.runtime.run import loop
from rldsl.runtime.config import load_config

from fault_helpers import BASE, assert_same_weights, child_env, final_weights, samples_of, step_numbers, steps_of


@pytest.fixture(scope="module")
def whole_run(model_dir, tmp_path_factory) -> Path:
    """4 steps, checkpoints step-2 and step-4."""
    out = tmp_path_factory.mktemp("whole") / "run"
    return loop.train("grpo", load_config(None, [f"model.path={model_dir}", f"out={out}", *BASE,
                                                 "train.steps=4", "checkpoint.every=2"]))


def _flip_last_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01  # a weight's last byte: the file still parses, the value is wrong
    f.write_bytes(bytes(data))


def _cut(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


DAMAGE = {
    "flipped byte": ("policy/model.safetensors", _flip_last_byte, "SHA-256 mismatch"),
    "cut file": ("optimizer.pt", _cut, "when written"),
    "missing file": ("state.pt", Path.unlink, "state.pt is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_previous_one(whole_run, tmp_path, capsys, damage):
    run = tmp_path / "run"
    shutil.copytree(whole_run, run)
    rel, spoil, why = DAMAGE[damage]
    spoil(run / "checkpoints" / "step-4" / rel)
    assert ckpt.verify_checkpoint(run / "checkpoints" / "step-2") is None
    assert why in ckpt.verify_checkpoint(run / "checkpoints" / "step-4")
    loop.train("grpo", resume=run)
    out = capsys.readouterr().out
    assert f"checkpoint step-4 is damaged ({rel}" in out and "resuming from step-2 instead" in out
    assert step_numbers(run) == [1, 2, 3, 4]
    assert steps_of(run) == steps_of(whole_run) and samples_of(run) == samples_of(whole_run)
    assert_same_weights(final_weights(run), final_weights(whole_run))  # steps 3-4 done again, exactly
    assert ckpt.verify_checkpoint(run / "checkpoints" / "damaged-step-4") is not None  # kept, not deleted


def _files(run: Path) -> dict[str, bytes]:
    return {str(f.relative_to(run)): f.read_bytes() for f in sorted(run.rglob("*")) if f.is_file()}


def test_a_run_whose_only_checkpoint_is_damaged_is_refused_untouched_until_restart(whole_run, tmp_path):
    """One checkpoint kept (step-4), a byte of its weights flipped: `--resume` exits 2 naming it,
    what is damaged and what is intact, and changes nothing; `--restart` starts again from step 0
    (the same weights as the uninterrupted run) with the earlier records kept in previous/1."""
    run = tmp_path / "run"
    shutil.copytree(whole_run, run)
    shutil.rmtree(run / "checkpoints" / "step-2")  # as checkpoint.keep_last=1 leaves it
    _flip_last_byte(run / "checkpoints" / "step-4" / "policy" / "model.safetensors")
    before = _files(run)
    res = subprocess.run([sys.executable, "-m", "rldsl.cli", "run", "--resume", str(run), "--steps", "4"],
                         env=child_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    err = res.stderr
    assert f"{run} cannot be resumed: every checkpoint it holds is damaged" in err, err
    assert "step-4: policy/model.safetensors differs from what was written (SHA-256 mismatch)" in err, err
    assert "intact: optimizer.pt, state.pt and the tokenizer and config files" in err, err
    assert f"`rldsl run --resume {run} --restart`" in err, err
    assert "starting it again" not in res.stdout + err
    assert _files(run) == before  # records, config and the damaged checkpoint as they were

    loop.train("grpo", resume=run, restart=True)
    kept = run / "previous" / "1"
    assert _files(kept) == {f: b for f, b in before.items()
                                                        if f.startswith(("metrics", "samples", "checkpoints", "trackers", "tb/"))}
    assert step_numbers(run) == [1, 2, 3, 4] and steps_of(run) == steps_of(whole_run)
    assert_same_weights(final_weights(run), final_weights(whole_run))


def test_restart_needs_a_run_folder(tmp_path):
    res = subprocess.run([sys.executable, "-m", "rldsl.cli", "run", "grpo", "--restart"], env=child_env(),
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2 and "--restart starts a run folder again from step 0" in res.stderr, res.stderr


def test_damage_a_resume_does_not_read_is_resumed_from_exactly(whole_run, tmp_path, capsys):
    """step-2's tokenizer.json damaged, step-4 gone: the resume continues from step-2 (it takes the
    tokenizer from the model source), says so, and ends with the uninterrupted run's weights."""
    run = tmp_path / "run"
    shutil.copytree(whole_run, run)
    shutil.rmtree(run / "checkpoints" / "step-4")
    spoiled = run / "checkpoints" / "step-2" / "policy" / "tokenizer.json"
    _flip_last_byte(spoiled)
    loop.train("grpo", resume=run)
    out = capsys.readouterr().out
    assert ("checkpoint step-2: policy/tokenizer.json differs from what was written (SHA-256 mismatch); "
            "a resume does not read it") in out and "resuming from it, exactly" in out
    assert step_numbers(run) == [1, 2, 3, 4] and steps_of(run) == steps_of(whole_run)
    assert_same_weights(final_weights(run), final_weights(whole_run))


def test_checkpoints_record_the_size_and_sha256_of_every_file(whole_run):
    import hashlib
    import json
    step = whole_run / "checkpoints" / "step-4"
    marker = json.loads((step / "COMPLETE").read_text())
    assert sorted(marker["sha256"]) == sorted(marker["bytes"]) == marker["files"]
    for rel in marker["files"]:
        assert marker["sha256"][rel] == hashlib.sha256((step / rel).read_bytes()).hexdigest()


def _namespaces_allowed() -> str | None:
    """Why this machine cannot mount a small tmpfs in a user + mount namespace, or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    res = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                         capture_output=True, text=True)
    return None if res.returncode == 0 else f"a tmpfs cannot be mounted here: {res.stderr.strip()}"


def test_a_full_disk_during_a_checkpoint_write_stops_the_run_and_keeps_the_previous_one(whole_run, model_dir,
                                                                                       tmp_path):
    """The run folder on a tmpfs with room for one checkpoint (and the run's logs) but not two."""
    reason = _namespaces_allowed()
    if reason:
        pytest.skip(reason)
    one = sum(f.stat().st_size for f in (whole_run / "checkpoints" / "step-2").rglob("*") if f.is_file())
    size_k = (one * 3 // 2) // 1024 + 64
    disk, run = tmp_path / "disk", tmp_path / "disk" / "run"
    disk.mkdir()
    args = [sys.executable, "-m", "rldsl.cli", "run", "grpo", "--model", str(model_dir), "--out", str(run)]
    for s in (*BASE, "train.steps=3"):
        args += ["--set", s]
    check = (f"from rldsl.runtime.records.checkpoint import load_checkpoint, latest_checkpoint, verify_checkpoint\n"
             f"p = latest_checkpoint({str(run)!r}); c = load_checkpoint(p)\n"
             f"print('newest', p.name, c.step, verify_checkpoint(p))\n"
             f"import os; print('left', sorted(os.listdir({str(run / 'checkpoints')!r})))")
    script = (f"mount -t tmpfs -o size={size_k}k tmpfs {disk} && "
              f"{subprocess.list2cmdline(args)}; echo exit=$?; {sys.executable} -c {_quote(check)}")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=child_env(), capture_output=True,
                         text=True, timeout=300)
    out = res.stdout + res.stderr
    assert "exit=1" in out, out[-3000:]
    assert "error: checkpoint step-2 could not be written" in out and "No space left on device" in out, out[-3000:]
    assert f"step-1 is whole: make room, then `rldsl run --resume {run}` continues from it" in out
    assert "newest step-1 1 None" in out  # loadable, every checksum right
    assert "left ['latest', 'step-1']" in out  # the partial folder was removed


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"
