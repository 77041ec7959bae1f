"""tinker-cookbook's own recipes, unchanged, against ``rldsl serve-tinker`` started by the test on a
free 127.0.0.1 port, offline (the model and dataset names resolve to folders of the test's home,
docs/tinker.md): each exits cleanly, and the recipe's own ``optim/kl_sample_train`` metrics are 0
at every step (the sampler's logprobs are the trainer's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinker_helpers import KEY, NAME

pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")

pytestmark = pytest.mark.slow


def _recipe(module: str, home: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=home, env=env, capture_output=True,
                          text=True, timeout=600)


def _metrics(log: Path) -> list[dict]:
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_math_rl_arithmetic_runs_and_the_sampler_is_the_trainer(start_server, tinker_home, tmp_path):
    log = tmp_path / "math-rl"
    with start_server() as url:
        done = _recipe("tinker_cookbook.recipes.math_rl.train", tinker_home, [
            f"base_url={url}", f"model_name={NAME}", "env=arithmetic", "group_size=2", "groups_per_batch=4",
            "max_tokens=5", "max_steps=3", "lora_rank=4", f"log_path={log}", "behavior_if_log_dir_exists=delete",
            "eval_every=0", "save_every=2"])
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in _metrics(log) if "optim/kl_sample_train_v1" in r]
    assert len(rows) == 3
    for r in rows:
        assert abs(r["optim/kl_sample_train_v1"]) < 1e-6 and abs(r["optim/kl_sample_train_v2"]) < 1e-6, r
        assert "env/all/reward/total" in r


def test_rl_loop_runs_to_a_clean_exit(start_server, tinker_home, tmp_path):
    log = tmp_path / "rl-loop"
    with start_server() as url:
        done = _recipe("tinker_cookbook.recipes.rl_loop", tinker_home, [
            f"base_url={url}", f"model_name={NAME}", "batch_size=4", "group_size=2", "max_tokens=8",
            "max_steps=2", "save_every=1", "lora_rank=4", f"log_path={log}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Training completed" in done.stderr + done.stdout
    assert [r["progress/batch"] for r in _metrics(log)] == [0, 1]


def test_the_multiplayer_guess_number_recipe_runs(start_server, tinker_home, tmp_path, monkeypatch):
    """A multi-turn recipe (the number-guessing game; it takes its address from TINKER_BASE_URL)."""
    log = tmp_path / "guess"
    with start_server() as url:
        monkeypatch.setenv("TINKER_BASE_URL", url)
        done = _recipe("tinker_cookbook.recipes.multiplayer_rl.guess_number.train", tinker_home, [
            f"model_name={NAME}", "renderer_name=role_colon", "group_size=2", "batch_size=2", "max_tokens=8",
            "max_steps=2", "eval_every=0", "save_every=0", f"log_path={log}", "behavior_if_log_dir_exists=delete"])
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in _metrics(log) if "optim/kl_sample_train_v1" in r]
    assert len(rows) == 2 and all(abs(r["optim/kl_sample_train_v1"]) < 1e-6 for r in rows)
