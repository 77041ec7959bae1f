"""The cookbook's math_rl recipe, unchanged, against ``rldsl serve-tinker``, for what only a run of
it shows: its own resume (``save_every=1`` writes ``save_weights`` states -- rldsl checkpoints,
``tinker://`` paths in its ``checkpoints.jsonl``; a new server on the same states folder, the
recipe run again on the same ``log_path`` with ``behavior_if_log_dir_exists=resume``, reads the
last one back and trains the remaining step), and a spec named on its command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tinker_helpers import KEY, NAME

pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")

pytestmark = pytest.mark.slow


def _math_rl(home, url, log, steps: int, behavior: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", f"base_url={url}",
                           f"model_name={NAME}", "env=arithmetic", "group_size=2", "groups_per_batch=4",
                           "max_tokens=5", f"max_steps={steps}", "lora_rank=4", f"log_path={log}",
                           f"behavior_if_log_dir_exists={behavior}", "eval_every=0", "save_every=1", *extra],
                          cwd=home, env=env, capture_output=True, text=True, timeout=600)


def test_the_recipe_resumes_from_its_saved_state_on_a_new_server(start_server, tinker_home, tmp_path):
    log, root = tmp_path / "math-rl", tmp_path / "states"
    with start_server(root=root) as url:
        first = _math_rl(tinker_home, url, log, 2, "delete")
    assert first.returncode == 0, first.stderr[-3000:]
    saved = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines() if line.strip()]
    assert saved and all(c["state_path"].startswith("tinker://") for c in saved if "state_path" in c)
    with start_server(root=root) as url:  # a new server: the states are read back from disk
        again = _math_rl(tinker_home, url, log, 3, "resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resumed training from tinker://" in again.stdout + again.stderr
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [r["progress/batch"] for r in rows if "optim/kl_sample_train_v1" in r]
    assert trained == [0, 1, 2], trained  # the resumed run trains step 2 only
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-6 for r in rows if "optim/kl_sample_train_v1" in r)


def test_the_recipe_trains_with_a_spec_named_on_its_command_line(start_server, tinker_home, tmp_path):
    """``loss_fn_config.rldsl_spec=dapo`` on the unchanged recipe's command line: it trains with
    DAPO's loss, and DAPO's clip fraction reaches the recipe's own metrics (``clip_fraction:mean``,
    from ``optim_step``)."""
    log = tmp_path / "dapo"
    with start_server() as url:
        done = _math_rl(tinker_home, url, log, 2, "delete", "loss_fn_config.rldsl_spec=dapo")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "optim/kl_sample_train_v1" in r]
    assert len(rows) == 2
    # on-policy (one update per batch, ratio 1): DAPO's clip takes nothing, and says so each step
    assert all(r["clip_fraction:mean"] == 0.0 for r in rows), rows
