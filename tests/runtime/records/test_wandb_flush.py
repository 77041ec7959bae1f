"""Why the tracker tests call ``wandb.teardown()`` before reading an offline run: W&B writes the
records after ``finish()`` returns, and only the service's teardown (a process's exit) waits for
them. Pinned here so that a W&B release that changes it is noticed."""
from __future__ import annotations

import pytest

from tracker_readers import wandb_history

wandb = pytest.importorskip("wandb")


@pytest.mark.slow  # wandb's own service process (docs/testing.md, the slow marker)
def test_every_step_is_in_the_offline_file_after_teardown(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for attempt, steps in enumerate(((1, 2), (3,))):  # a run, then its resume (same id)
        run = wandb.init(project="p", id="flush123", dir=str(tmp_path), resume="allow")
        for step in steps:
            run.log({"x": float(step)}, step=step)
        run.finish()
    history, _, ids = wandb_history(tmp_path)
    assert ids == {"flush123"}
    assert {s: v["x"] for s, v in history.items()} == {1: 1.0, 2: 2.0, 3: 3.0}
