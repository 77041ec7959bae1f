"""The run folder: default names, atomic writes, the copies of the spec and its parents."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

from rldsl.runtime.config import RunConfig
from rldsl.runtime.records.run_dir import default_run_dir, run_dir_of, save_parent_specs, write_text_atomic


def test_default_run_dir(tmp_path):
    now = datetime(2025, 3, 4, 5, 6, 7)
    first = default_run_dir("algorithms/grpo.rl", tmp_path, now)
    assert first == tmp_path / "grpo-20250304-050607"
    first.mkdir()
    assert default_run_dir("grpo", tmp_path, now) == tmp_path / "grpo-20250304-050607-2"
    assert run_dir_of(RunConfig(out="x/y"), "grpo") == Path("x/y")


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "x.json"
    write_text_atomic(path, "old\n")
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_parent_specs_are_copied_next_to_the_spec(tmp_path):
    save_parent_specs(tmp_path, {"grpo": "algorithm grpo\n", "base": "algorithm base\n"})
    assert (tmp_path / "grpo.rl").read_text() == "algorithm grpo\n"
    assert (tmp_path / "base.rl").read_text() == "algorithm base\n"
