"""A Ray cluster the user runs (`ray start` on two nodes), joined with ``--ray-address``: a run of
2 trainer ranks and a rollout worker spread over both nodes, one node's raylet SIGKILLed between
two steps. What must hold (docs/reliability.md): the actor the node ran is restarted and the run
goes on (a rollout worker), or the run stops with an error naming it and a resume command that
finishes the run (a trainer rank); each step is logged once. Every Ray process listens on
127.0.0.1 only. The steps run in ray_nodes.py, inside network and UTS namespaces of their own
(why: its docstring)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fault_helpers import HERE, child_env, samples_of, step_numbers

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")


def _namespaces_allowed() -> str | None:
    """Why this machine cannot give a process network and UTS namespaces of its own, or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    res = subprocess.run(["unshare", "-rnu", "true"], capture_output=True, text=True)
    return None if res.returncode == 0 else f"no network namespace can be made here: {res.stderr.strip()}"


def _left_behind(workdir: Path) -> list[psutil.Process]:
    """Processes whose command line names this test's folder (Ray's temp folder is in it)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(str(workdir) in part for part in p.info["cmdline"] or []):
            found.append(p)
    return found


def test_a_run_on_a_two_node_cluster_started_outside_survives_a_lost_node(model_dir):
    reason = _namespaces_allowed()
    if reason:
        pytest.skip(reason)
    workdir = Path(tempfile.mkdtemp(prefix="rldsl-nodes-", dir="/tmp"))  # short: Ray's socket paths
    try:
        res = subprocess.run(["unshare", "-rnu", sys.executable, str(HERE / "ray_nodes.py"), str(model_dir),
                              str(workdir)], env=child_env(), capture_output=True, text=True, timeout=1500)
        facts_file = workdir / "facts.json"
        assert facts_file.exists(), res.stdout[-3000:] + res.stderr[-3000:]
        facts = json.loads(facts_file.read_text(encoding="utf-8"))
        assert "error" not in facts, facts["error"]

        off = [x for x in facts["listeners"] if x["address"] not in ("127.0.0.1", "::ffff:127.0.0.1")]
        if off:  # never bind another address: say why instead
            pytest.skip(f"Ray could not be held on 127.0.0.1 here; it listened on {off}")
        assert {6379, 10001} <= {x["port"] for x in facts["listeners"]}  # the GCS, the client server
        during = [x for x in facts["listeners_during_run"] if x["address"] not in ("127.0.0.1", "::ffff:127.0.0.1")]
        assert not during, during  # the trainers' store and gloo too

        placed = facts["actors"]
        assert sorted(placed["head"] + placed["node2"]) == ["ray::RolloutWorker", "ray::TrainerWorker",
                                                            "ray::TrainerWorker"]
        assert placed["head"] and placed["node2"]  # the run spans both nodes
        run, out = workdir / "run", facts["run"]["output"]
        print(f"lost with node2: {placed['node2']}; replaced in {facts['run']['replacement_s']:.1f} s; the run "
              f"exited {facts['run']['exit']} {facts['run']['to_exit_s']:.1f} s later; resume: "
              f"{ {k: v for k, v in facts.get('resume', {}).items() if k != 'output'} }")  # the fault table's row
        if placed["node2"] == ["ray::RolloutWorker"]:  # restarted on the node that replaced it
            assert facts["run"]["exit"] == 0, out
            assert "restarting it (1 of distributed.max_restarts=3)" in out, out
        else:  # a trainer rank lost: a clear stop, and the command it names finishes the run
            assert facts["run"]["exit"] == 1, out
            assert "error: trainer rank" in out and "complete checkpoint step-2" in out, out
            assert f"`rldsl run --resume {run}`" in out, out
            assert facts["resume"]["exit"] == 0, facts["resume"]["output"]
        assert step_numbers(run) == [1, 2, 3, 4]  # each step once, the counter continuing
        assert sorted({s["step"] for s in samples_of(run)}) == [1, 2, 3, 4]
        assert facts["left"] == []
    finally:
        stray = _left_behind(workdir)
        for p in stray:  # by pid: the machine may run other Ray clusters
            p.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    assert not stray, f"processes left running: {stray}"
