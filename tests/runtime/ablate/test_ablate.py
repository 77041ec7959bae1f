"""rldsl ablate: the grid, the cell specs, the launcher's decisions, the report, and a real
2x2 study on the embedded default (few steps) that resumes and survives failing cells."""
from __future__ import annotations

import csv
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import rldsl
from rldsl.explain import diff
from rldsl.runtime.ablate.grid import build_study, parse_vary, read_grid_file, write_cells
from rldsl.runtime.ablate.report import run_numbers, window
from rldsl.runtime.ablate.launch import cell_state
from rldsl.runtime.cli import register
from rldsl.runtime.errors import GridError

runner = CliRunner()


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def invoke(app, *args):
    return runner.invoke(app, ["ablate", *[str(a) for a in args]])


# ----------------------------------------------------------------------------- the grid

def test_parse_vary_labels_alternatives_and_rejects_bad_axes():
    assert parse_vary("normalizer: group_std | batch_std(eps=1e-6)") == (
        "normalizer", [(None, "group_std"), (None, "batch_std(eps=1e-6)")])
    assert parse_vary(" trust_region :clip_higher = clip(low=0.2, high=0.28) | none") == (
        "trust_region", [("clip_higher", "clip(low=0.2, high=0.28)"), (None, "none")])
    assert parse_vary("filter: overlong, zero_variance | none")[1][0] == (None, "overlong, zero_variance")
    with pytest.raises(GridError, match="unknown slot 'normalizr'.*did you mean 'normalizer'"):
        parse_vary("normalizr: group_std")
    with pytest.raises(GridError, match="expected 'SLOT: COMPONENT"):
        parse_vary("group_std | batch_std")
    with pytest.raises(GridError, match="empty alternative"):
        parse_vary("normalizer: group_std || none")
    with pytest.raises(GridError, match="one line only"):
        parse_vary("normalizer: none\nkl k3(beta=1)")
    with pytest.raises(GridError, match="label 'Big'"):
        parse_vary("normalizer: Big = none")


def test_one_at_a_time_writes_plain_specs_that_extend_the_base(tmp_path, monkeypatch):
    study = build_study("lite_ppo", [
        "normalizer: group_std(eps=1e-6) | batch_std(eps=1e-6) | none",
        "trust_region: clip_higher = clip(low=0.2, high=0.28)",
        "algorithm: grpo | dapo"], one_at_a_time=True, seeds=2)
    variants, dropped = write_cells(study, tmp_path / "study")
    assert [v.name for v in variants] == ["base", "group_std", "none", "clip_higher", "grpo", "dapo"]
    assert [v.label for v in dropped] == ["batch_std"]  # = the base's normalizer: not run twice
    assert study.seeds == [0, 1] and study.steps == 300  # the run config's default
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # cells resolve their parent from any working directory
    cells = tmp_path / "study" / "cells"
    assert sorted(p.name for p in cells.iterdir()) == sorted(f"{v.name}.rl" for v in variants)
    base = rldsl.load("lite_ppo")
    for v in variants:
        algo = rldsl.load(str(cells / f"{v.name}.rl"))
        assert algo.extends == ["lite_ppo"]
        assert diff(base, algo)["differences"] == len(v.diff_rows)
    assert diff(base, rldsl.load(str(cells / "base.rl")))["differences"] == 0
    clip = rldsl.load(str(cells / "clip_higher.rl"))["trust_region"]
    assert (clip.component, clip.params["high"]) == ("clip", 0.28)
    assert next(v for v in variants if v.name == "none").changes == [
        "normalizer: batch_std(eps=1e-06, unbiased=true) -> none"]
    for name in ("grpo", "dapo"):  # an `algorithm` alternative is that spec, derived from the base
        assert diff(rldsl.load(name), rldsl.load(str(cells / f"{name}.rl")))["differences"] == 0


@pytest.mark.parametrize("name", sorted(rldsl.library()))
def test_every_library_algorithm_can_be_an_alternative(name, tmp_path):
    study = build_study("grpo", [f"algorithm: {name}"], seeds=1)
    [variant], _ = write_cells(study, tmp_path)
    assert variant.error is None
    assert diff(rldsl.load(name), rldsl.load(str(tmp_path / "cells" / f"{variant.name}.rl")))["differences"] == 0


def test_full_grid_is_the_product_and_automatic_labels_stay_short(tmp_path):
    study = build_study("lite_ppo", ["aggregation: token_mean | seq_mean_token_mean",
                                     "trust_region: clip(low=0.2, high=0.2) | clip(low=0.2, high=0.28) | none"],
                        seeds=1)
    names = [v.name for v in study.variants()]
    assert len(names) == 6 and len(set(names)) == 6
    # the same component twice: the parameters tell them apart
    assert "seq_mean_token_mean__clip_low_0p2_high_0p28" in names
    assert "token_mean__none" in names
    variants, dropped = write_cells(study, tmp_path)
    assert len(variants) == 6 and not dropped  # a full grid keeps the base's own combination
    assert next(v for v in variants if v.name == "token_mean__clip_low_0p2_high_0p2").changes == []


def test_a_base_file_is_copied_so_the_study_folder_stands_alone(tmp_path, monkeypatch):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "parent_algo.rl").write_text("algorithm parent_algo extends grpo\n  kl none\n")
    (user / "my_algo.rl").write_text("algorithm my_algo extends parent_algo\n  aggregation token_mean\n")
    study = build_study(str(user / "my_algo.rl"), ["normalizer: batch_std | none"], seeds=1)
    variants, _ = write_cells(study, tmp_path / "study")
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "study", moved)
    shutil.rmtree(user)  # the copies next to the cells are enough
    monkeypatch.chdir(tmp_path)
    for v in variants:
        algo = rldsl.load(str(moved / "cells" / f"{v.name}.rl"))
        assert algo.extends == ["my_algo", "parent_algo", "grpo"]
        assert algo["aggregation"].component == "token_mean" and algo["kl"].component == "none"


def test_names_of_the_base_and_its_parents_are_not_reused(tmp_path):
    study = build_study("dapo", ["algorithm: grpo | dapo | lite_ppo"], seeds=1)
    variants, _ = write_cells(study, tmp_path)
    assert [v.name for v in variants] == ["grpo_cell", "dapo_cell", "lite_ppo"]
    assert all(v.error is None for v in variants)


def test_an_invalid_alternative_is_kept_with_the_checkers_message(tmp_path):
    study = build_study("lite_ppo", ["normalizer: group_stdd | none"], one_at_a_time=True, seeds=1)
    variants, _ = write_cells(study, tmp_path)
    bad = next(v for v in variants if v.name == "group_stdd")
    assert "cells/group_stdd.rl:6:15: error: unknown normalizer 'group_stdd'" in bad.error
    assert "did you mean 'group_std'" in bad.error
    assert next(v for v in variants if v.name == "none").error is None


def test_set_keys_are_checked_and_the_study_owns_seed_and_out():
    with pytest.raises(GridError, match="seed"):
        build_study("grpo", ["kl: none"], sets=["seed=3"])
    with pytest.raises(GridError, match="train.lrr"):
        build_study("grpo", ["kl: none"], sets=["train.lrr=1e-4"])
    assert build_study("grpo", ["kl: none"], sets=["train.steps=7", "train.lr=1e-4"]).steps == 7
    assert build_study("grpo", ["kl: none"], sets=["train.steps=7"], steps=9).steps == 9
    with pytest.raises(GridError, match="slot is varied twice"):
        build_study("grpo", ["kl: none", "kl: k1(beta=0.1)"])
    with pytest.raises(GridError, match="nothing to vary"):
        build_study("grpo", [])


def test_the_study_digest_ignores_seeds_and_steps_only():
    a = build_study("grpo", ["kl: none"], seeds=1, steps=5)
    assert a.digest() == build_study("grpo", ["kl: none"], seeds=3, steps=50, threshold=0.9).digest()
    assert a.digest() != build_study("grpo", ["kl: none"], sets=["train.lr=1e-4"]).digest()
    assert a.digest() != build_study("grpo", ["kl: none"], one_at_a_time=True).digest()


def test_grid_file_keys_types_and_relative_base(tmp_path):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "b.rl").write_text("algorithm b extends grpo\n")
    grid = tmp_path / "g.toml"
    grid.write_text('base = "specs/b.rl"\nvary = ["kl: none | k1(beta=0.1)"]\nseeds = 2\n'
                    'set = ["train.lr=1e-4"]\none_at_a_time = true\n')
    data = read_grid_file(grid)
    assert data["base"] == str(tmp_path / "specs" / "b.rl") and data["seeds"] == 2
    grid.write_text('base = "grpo"\nvaryy = ["kl: none"]\n')
    with pytest.raises(GridError, match="unknown key 'varyy'.*did you mean 'vary'"):
        read_grid_file(grid)
    grid.write_text('base = "grpo"\nseeds = "3"\n')
    with pytest.raises(GridError, match="seeds = '3' has the wrong type"):
        read_grid_file(grid)
    grid.write_text('base = "grpo"\nseeds = true\n')
    with pytest.raises(GridError, match="wrong type"):
        read_grid_file(grid)
    grid.write_text('base = "grpo"\nvary = "kl: none"\n')
    with pytest.raises(GridError, match="vary must be a list of strings"):
        read_grid_file(grid)
    with pytest.raises(GridError, match="grid file not found"):
        read_grid_file(tmp_path / "nope.toml")


def test_the_study_grid_in_docs_is_valid(tmp_path):
    path = Path(__file__).resolve().parents[3] / "docs" / "tricks_or_traps.toml"
    data = read_grid_file(path)
    study = build_study(data["base"], data["vary"], one_at_a_time=data["one_at_a_time"],
                        seeds=data["seeds"], steps=data.get("steps"), sets=data["set"],
                        threshold=data["threshold"], name=data["name"])
    variants, dropped = write_cells(study, tmp_path)
    assert not dropped and all(v.error is None for v in variants)
    assert study.seeds == [0, 1, 2]
    assert any(s.startswith(("train.minibatches=", "train.ppo_epochs=")) for s in study.sets)
    changed = {row["slot"] for v in variants for row in v.diff_rows}
    assert {"normalizer", "trust_region", "aggregation", "filter"} <= changed
    assert {"grpo", "dapo"} <= {v.name for v in variants}


# ----------------------------------------------------------------------------- numbers

def test_run_numbers_final_best_threshold_and_end_window():
    records = [{"step": 0, "eval/greedy_acc": 0.3}]
    for step in range(1, 21):
        r = {"step": step, "reward_mean": step / 20, "response_length": 3.0 + (step > 18),
             "entropy": 1.0 / step, "clip_fraction": 0.0}
        if step % 5 == 0:
            r["eval/greedy_acc"] = {5: 0.4, 10: 0.7, 15: 0.65, 20: 0.6}[step]
        records.append(r)
    records.append({"step": 21, "eval/greedy_acc": 0.99})  # past the study's steps: ignored
    n = run_numbers(records, steps=20, threshold=0.6)
    assert window(20) == 2
    assert (n.steps, n.start_acc, n.final_acc, n.best_acc) == (20, 0.3, 0.6, 0.7)
    assert n.steps_to_threshold == 10
    assert n.final_reward == pytest.approx((19 + 20) / 2 / 20)
    assert n.best_reward == pytest.approx(n.final_reward)  # rising: the last window is the best
    assert n.final_response_length == 4.0 and n.final_entropy == pytest.approx((1 / 19 + 1 / 20) / 2)
    assert run_numbers(records, steps=20, threshold=0.8).steps_to_threshold is None
    assert run_numbers([{"step": 0}], steps=5, threshold=0.5).final_acc is None


# ----------------------------------------------------------------------------- the launcher

def _fake_checkpoint(run_dir: Path, step: int) -> None:
    path = run_dir / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text(json.dumps({"format": 1, "step": step, "files": []}))


def _metrics(run_dir: Path, last: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(last + 1):
            f.write(json.dumps({"step": step}) + "\n")
        f.write('{"step": 9')  # a line cut by a kill is ignored


def test_cell_state_decides_skip_resume_or_restart(tmp_path):
    run = tmp_path / "r"
    assert cell_state(run, 4) == ("new", 0)
    _metrics(run, 2)
    assert cell_state(run, 4) == ("restart", 2)  # killed before its first checkpoint
    _fake_checkpoint(run, 2)
    assert cell_state(run, 4) == ("resume", 2)
    _metrics(run, 4)
    assert cell_state(run, 4) == ("resume", 4)  # logged step 4, killed before saving it
    assert cell_state(run, 4, save_final=False) == ("done", 4)
    _fake_checkpoint(run, 4)
    assert cell_state(run, 4) == ("done", 4)
    assert cell_state(run, 3) == ("done", 4)
    assert cell_state(run, 6) == ("resume", 4)  # more steps: the run goes on


# ----------------------------------------------------------------------------- the command

def test_command_line_errors_exit_2_without_running(app, tmp_path):
    r = invoke(app, "lite_ppo", "--vary", "normaliser: none", "--out", tmp_path / "s")
    assert r.exit_code == 2 and "unknown slot 'normaliser'" in r.output
    r = invoke(app, "lite_ppo", "--vary", "kl: none", "--set", "train.lrr=1", "--out", tmp_path / "s")
    assert r.exit_code == 2 and "train.lrr" in r.output
    r = invoke(app, "--vary", "kl: none")
    assert r.exit_code == 2 and "missing BASE" in r.output
    bad = tmp_path / "bad.rl"
    bad.write_text("algorithm bad\n  baseline group_mena\n")
    r = invoke(app, bad, "--vary", "kl: none", "--out", tmp_path / "s")
    assert r.exit_code == 2 and "bad.rl:2:12: error: unknown baseline 'group_mena'" in r.output
    r = invoke(app, "--report", tmp_path)
    assert r.exit_code == 2 and "not a study folder" in r.output
    other = tmp_path / "other"
    other.mkdir()
    (other / "study.json").write_text(json.dumps({"definition": {"base": "grpo"}}))
    r = invoke(app, "lite_ppo", "--vary", "kl: none", "--out", other)
    assert r.exit_code == 2 and "holds another study (changed: the base spec)" in r.output
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("mine")
    r = invoke(app, "lite_ppo", "--vary", "kl: none", "--out", tmp_path / "busy")
    assert r.exit_code == 2 and "not a study folder" in r.output
    assert not (tmp_path / "s").exists()


FAST = ["--set", "data.eval_size=8", "--set", "eval.samples=0", "--set", "rollout.prompts_per_step=4",
        "--set", "rollout.n=4", "--set", "checkpoint.every=1", "--set", "checkpoint.keep_last=0"]


def _csv(folder: Path) -> dict[str, dict[str, str]]:
    with open(folder / "results.csv", newline="") as f:
        return {row["variant"]: row for row in csv.DictReader(f)}


@pytest.mark.slow
def test_a_2x2_study_runs_resumes_and_survives_failing_cells(app, tmp_path, monkeypatch):
    """The embedded default, 2 steps, one seed: (reinforce, clip) is an invalid spec."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # the study folder is elsewhere: cells run from another directory
    study = tmp_path / "study"
    args = ["lite_ppo", "--vary", "objective: ppo | reinforce",
            "--vary", "trust_region: clip(low=0.2, high=0.2) | none",
            "--seeds", 1, "--steps", 2, "--jobs", 2, "--threshold", 0.1, "--out", study, *FAST]
    names = ["ppo__clip", "ppo__none", "reinforce__clip", "reinforce__none"]

    r = invoke(app, *args)
    assert r.exit_code == 1, r.output  # one cell is invalid, the three others finished
    assert "reinforce__clip-s0: invalid" in r.output and "has no ratio" in r.output
    for name in ("ppo__clip", "ppo__none", "reinforce__none"):
        assert f"{name}-s0: done | step 2/2" in r.output
    assert "1 of 4 cells did not finish" in r.output
    rows = _csv(study)
    assert sorted(rows) == names
    assert rows["reinforce__clip"]["status"] == "invalid"
    for name in ("ppo__clip", "ppo__none", "reinforce__none"):
        assert rows[name]["status"] == "done" and rows[name]["steps"] == "2"
        assert 0.0 <= float(rows[name]["final_acc"]) <= 1.0
    # entropy comes from the loss: a cell whose groups all had zero advantage made no update
    # and has none to report; a cell that updated reports a number
    for name in ("ppo__clip", "ppo__none", "reinforce__none"):
        records = [json.loads(ln) for ln in
                   (study / "runs" / f"{name}-s0" / "metrics.jsonl").read_text().splitlines()]
        updated = any(r.get("optimizer_steps", 0) > 0 for r in records)
        assert bool(rows[name]["final_entropy"]) == updated, name
        if updated:
            assert float(rows[name]["final_entropy"]) >= 0.0
    report = (study / "report.md").read_text()
    for label in ("`ppo, clip`", "`ppo, none`", "`reinforce, clip`", "`reinforce, none`"):
        assert f"| {label} |" in report
    assert "trust_region: clip(low=0.2, high=0.2) → none; objective: ppo → reinforce" in report
    assert "objective 'reinforce' has no ratio to put a trust region on" in report
    assert (study / "figures" / "heldout_greedy_acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![held-out accuracy (greedy)](figures/heldout_greedy_acc.png)" in report
    spec = json.loads((study / "runs" / "ppo__none-s0" / "config.json").read_text())
    assert spec["seed"] == 0 and spec["train"]["steps"] == 2 and spec["rollout"]["n"] == 4

    # the same command again: every finished cell is skipped, nothing runs
    logs = {p.name: p.read_text() for p in (study / "logs").iterdir()}
    r = invoke(app, *args)
    assert r.exit_code == 1, r.output
    assert r.output.count("done (finished earlier)") == 3
    assert {p.name: p.read_text() for p in (study / "logs").iterdir()} == logs

    # an interrupted cell (its last checkpoint lost) resumes; a run that fails is reported
    shutil.rmtree(study / "runs" / "ppo__none-s0" / "checkpoints" / "step-2")
    shutil.rmtree(study / "runs" / "reinforce__none-s0")
    (study / "runs" / "reinforce__none-s0").write_text("in the way")
    r = invoke(app, *args)
    assert r.exit_code == 1, r.output
    assert "ppo__none-s0: done (resumed) | step 2/2" in r.output
    assert "reinforce__none-s0: failed" in r.output and "2 of 4 cells did not finish" in r.output
    status = json.loads((study / "status.json").read_text())["cells"]
    assert status["ppo__none-s0"]["action"] == "resume" and status["ppo__clip-s0"]["action"] == "skip"
    failed = status["reinforce__none-s0"]
    assert failed["status"] == "failed" and failed["returncode"] == 2  # its --out is a file: refused up front
    assert "is a file, not a folder" in failed["error"]
    steps = [json.loads(line)["step"] for line in
             (study / "runs" / "ppo__none-s0" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]  # resumed from step 1: step 2 once, not twice
    assert "--resume" in (study / "logs" / "ppo__none-s0.log").read_text()
    report = (study / "report.md").read_text()
    assert "`reinforce, none` seed 0: failed, exit code 2" in report and "is a file, not a folder" in report
    assert _csv(study)["reinforce__none"]["status"] == "failed"

    # the report is rebuilt from the run folders alone
    (study / "report.md").unlink()
    r = invoke(app, "--report", study)
    assert r.exit_code == 0 and (study / "report.md").read_text().count("| `") == 4

    # a cell spec is a plain spec: it reruns with `rldsl run` from another directory
    algo = rldsl.load(str(study / "cells" / "reinforce__none.rl"))
    assert (algo["objective"].component, algo["trust_region"].component) == ("reinforce", "none")
    grid = read_grid_file(study / "grid.toml")
    assert grid["steps"] == 2 and grid["seeds"] == 1 and "eval.samples=0" in grid["set"]


@pytest.mark.slow
def test_ray_executor_runs_a_cell_command_as_a_task(tmp_path):
    ray = pytest.importorskip("ray")
    import tempfile

    from rldsl.runtime.ablate.launch import RayExecutor

    tmp = tempfile.mkdtemp(prefix="rldsl-ray-", dir="/tmp")  # short: Ray's socket paths
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             _temp_dir=tmp, _node_ip_address="127.0.0.1")
    try:
        executor = RayExecutor("auto", None)
        assert executor.jobs == 1
        log = tmp_path / "cell.log"
        code = "import os, sys; print('threads', os.environ['OMP_NUM_THREADS']); sys.exit(3)"
        fut = executor.submit([sys.executable, "-c", code], log, {"OMP_NUM_THREADS": "1"},
                              os.getcwd())
        assert fut.result(timeout=120) == 3
        assert "threads 1" in log.read_text()
        executor.close()
        assert ray.is_initialized()  # a cluster the study did not start is left running
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- the pool

def _fake_cells(tmp_path, monkeypatch, scripts):
    """Two cells whose `rldsl run` is replaced by the given Python one-liners."""
    from rldsl.runtime.ablate import launch

    study = build_study("lite_ppo", ["normalizer: group_std | none"], seeds=1, steps=3)
    variants, _ = write_cells(study, tmp_path)
    cells = [launch.Cell(v, 0, tmp_path) for v in variants]
    by_spec = {str(c.spec): s for c, s in zip(cells, scripts)}
    monkeypatch.setattr(launch, "cell_command",
                        lambda cell, study, action: [sys.executable, "-c", by_spec[str(cell.spec)]])
    return launch, study, cells


def test_a_failing_process_is_recorded_with_its_output_and_the_other_finishes(tmp_path, monkeypatch):
    runner_mod, study, cells = _fake_cells(tmp_path, monkeypatch, [
        "import sys; print('loading'); print('error: boom', file=sys.stderr); sys.exit(3)",
        "print('fine')"])
    executor = runner_mod.LocalExecutor(2)
    ends = []
    statuses = runner_mod.run_cells(cells, study, executor,
                                    notify=lambda c, s, e: ends.append((c.name, e)))
    executor.close()
    failed, fine = statuses[cells[0].name], statuses[cells[1].name]
    assert (failed.status, failed.returncode, failed.action) == ("failed", 3, "run")
    assert failed.error == "loading\nerror: boom"  # the output's tail, without the command line
    assert (fine.status, fine.returncode) == ("done", 0)
    assert sorted(ends) == sorted([(c.name, e) for c in cells for e in ("start", "end")])
    assert runner_mod.read_status(tmp_path)[cells[0].name].error == "loading\nerror: boom"
    assert runner_mod.unfinished(statuses.values()) == 1


def test_an_interrupt_stops_the_running_cells_with_sigterm(tmp_path, monkeypatch):
    wait_for_term = ("import signal, sys, time\n"
                     "signal.signal(signal.SIGTERM, lambda *a: (print('saved'), sys.exit(130)))\n"
                     "print('started', flush=True)\ntime.sleep(60)")
    runner_mod, study, cells = _fake_cells(tmp_path, monkeypatch, [wait_for_term] * 2)
    executor = runner_mod.LocalExecutor(2)

    def refresh():  # Ctrl-C once both cells run
        if all(c.log.is_file() and "started" in c.log.read_text() for c in cells):
            raise KeyboardInterrupt

    ends = []
    with pytest.raises(KeyboardInterrupt):
        runner_mod.run_cells(cells, study, executor, refresh=refresh,
                             notify=lambda c, s, e: ends.append((c.name, s.status, e)))
    executor.close()
    saved = runner_mod.read_status(tmp_path)
    assert [saved[c.name].status for c in cells] == ["interrupted", "interrupted"]
    assert sorted(n for n, status, e in ends if e == "end" and status == "interrupted") == \
        sorted(c.name for c in cells)
    assert all("saved" in c.log.read_text() for c in cells)  # each got SIGTERM and exited
