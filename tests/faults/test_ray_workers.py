"""A Ray rollout worker SIGKILLed while the run goes on: restarted (``distributed.max_restarts``),
given the weights it held and asked again, so the run ends as an uninterrupted one; with no
restarts left, the run stops with a clear error whose resume command works."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from rldsl.runtime.run import loop
from rldsl.runtime.run import schedule
from rldsl.runtime.config import load_config
from rldsl.runtime.errors import WorkerError

from fault_helpers import BASE, final_weights, samples_of, step_numbers, steps_of
from local_ray import local_ray

#: metrics that depend on the samples only
SAMPLED = ("reward_mean", "accuracy", "response_length", "truncated_fraction", "reward_errors")

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(2):
        yield


def config(model_dir: Path, out: Path, *sets: str):
    return load_config(None, [f"model.path={model_dir}", f"out={out}", *BASE, "train.steps=4",
                              "distributed.rollout_workers=1", "distributed.sync_timeout=120", *sets])


def assert_same_samples(run: Path, ref: Path) -> None:
    """The same samples and rewards at every step; the numbers computed from them agree to float
    rounding (a trainer rank on Ray and the one-process trainer do not sum bitwise alike)."""
    assert step_numbers(run) == step_numbers(ref)
    for a, b in zip(steps_of(run), steps_of(ref), strict=True):
        assert {k: a[k] for k in SAMPLED} == {k: b[k] for k in SAMPLED}
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    text = [[(r["step"], r["prompt"], r["completion"], r["reward"]) for r in samples_of(x)] for x in (run, ref)]
    assert text[0] == text[1]


def _own_ray_processes(title: str) -> list[int]:
    """The pids of this test's Ray processes named ``title`` (descendants of this process: the
    machine may run other Ray clusters)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if (p.cmdline() or [""])[0].startswith(title):
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _worker_pids() -> list[int]:
    return _own_ray_processes("ray::RolloutWorker")


def kill_rollout_worker_before(monkeypatch, steps: set[int]) -> list[int]:
    """SIGKILL the rollout worker's process right before each of these steps (1-based), once it is
    gone; returns the pids killed."""
    real_step, killed = schedule.train_step, []

    def step(s, i, producer=None):
        if i + 1 in steps:
            pids = _worker_pids()
            assert len(pids) == 1, pids
            os.kill(pids[0], signal.SIGKILL)
            psutil.wait_procs([psutil.Process(pids[0])], timeout=30)
            killed.append(pids[0])
        return real_step(s, i, producer)

    monkeypatch.setattr(schedule, "train_step", step)
    return killed


def test_a_killed_rollout_worker_is_restarted_and_the_run_goes_on_unchanged(ray_cluster, model_dir, reference,
                                                                            tmp_path, monkeypatch, capfd):
    killed = kill_rollout_worker_before(monkeypatch, {2, 3})
    run = loop.train("grpo", config(model_dir, tmp_path / "run"))
    assert len(killed) == 2 and len(set(killed)) == 2  # a new process the second time
    err = capfd.readouterr().err
    assert "restarting it (1 of distributed.max_restarts=3)" in err  # each death counted once
    assert "restarting it (2 of distributed.max_restarts=3)" in err and "(3 of" not in err
    monkeypatch.undo()
    ref = reference("train.steps=4")  # uninterrupted, in one process (one rollout worker samples as it)
    assert_same_samples(run, ref)  # the samples it would have had
    a, b = final_weights(run), final_weights(ref)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_spent_restarts_stop_the_run_with_a_resume_command_that_works(ray_cluster, model_dir, tmp_path,
                                                                      monkeypatch):
    kill_rollout_worker_before(monkeypatch, {3})
    run = tmp_path / "run"
    with pytest.raises(WorkerError) as e:
        loop.train("grpo", config(model_dir, run, "distributed.max_restarts=0"))
    msg = str(e.value)
    assert "rollout worker 0" in msg and "distributed.max_restarts=0 restarts are spent" in msg
    assert "complete checkpoint step-2" in msg and f"rldsl run --resume {run}" in msg
    monkeypatch.undo()
    loop.train(None, resume=run)  # the hint's command, in this process
    assert step_numbers(run) == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama sequence-classification reward model with the toy tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rldsl.runtime import toy
    tok = toy.build_tokenizer()
    path = tmp_path_factory.mktemp("rm")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _kill_before(monkeypatch, step_no: int, title: str) -> list[int]:
    real_step, killed = schedule.train_step, []

    def step(s, i, producer=None):
        if i + 1 == step_no:
            pids = _own_ray_processes(title)
            assert len(pids) == 1, pids
            os.kill(pids[0], signal.SIGKILL)
            psutil.wait_procs([psutil.Process(pids[0])], timeout=30)
            killed.append(pids[0])
        return real_step(s, i, producer)

    monkeypatch.setattr(schedule, "train_step", step)
    return killed


def test_a_killed_reward_model_actor_is_restarted_and_scores_the_same(ray_cluster, model_dir, reward_model_dir,
                                                                      tmp_path, monkeypatch):
    """rm:PATH(actor=true) in a one-process run: its actor SIGKILLed before step 3's scoring."""
    rm = f"reward.name=rm:{reward_model_dir}(actor=true)"
    killed = _kill_before(monkeypatch, 3, "ray::RewardModel")
    run = loop.train("grpo", config(model_dir, tmp_path / "run", rm, "distributed.rollout_workers=0"))
    assert len(killed) == 1
    monkeypatch.undo()  # uninterrupted, in one process, the reward model in it too
    ref = loop.train("grpo", config(model_dir, tmp_path / "ref", f"reward.name=rm:{reward_model_dir}",
                                    "distributed.rollout_workers=0"))
    assert_same_samples(run, ref)  # every sample scored, as without the fault


def test_a_reward_model_actor_with_no_restarts_left_stops_the_run(ray_cluster, model_dir, reward_model_dir,
                                                                  tmp_path, monkeypatch):
    rm = f"reward.name=rm:{reward_model_dir}(actor=true, max_restarts=0)"
    _kill_before(monkeypatch, 3, "ray::RewardModel")
    run = tmp_path / "run"
    with pytest.raises(WorkerError) as e:
        loop.train("grpo", config(model_dir, run, rm, "distributed.rollout_workers=0"))
    msg = str(e.value)
    assert "the reward model actor" in msg and "max_restarts=0 restarts are spent" in msg
    assert f"rldsl run --resume {run}" in msg


def _killed_whole_at(args: list[str], held: Path, point: str) -> None:
    """`rldsl ARGS` held at ``point``, then SIGKILLed with every process it started (the driver,
    its local Ray, the rollout worker); nothing of it is left running."""
    from fault_helpers import start, wait_held

    proc = start(args, held, point)
    try:
        wait_held(proc, held)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert any((p.cmdline() or [""])[0].startswith("ray::RolloutWorker") for p in family)
    finally:
        family = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        for p in [psutil.Process(proc.pid), *family] if proc.poll() is None else family:
            try:
                p.kill()  # SIGKILL: the driver, Ray's own processes, the actor
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=60)
        psutil.wait_procs(family, timeout=30)
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # nothing left


def test_a_ray_run_killed_whole_resumes(ray_cluster, model_dir, tmp_path):
    """`rldsl run` with a Ray rollout worker (its own local Ray), held mid-update of step 3 and
    SIGKILLed with every process it started; resumed, and killed again in the weight sync to the
    worker after step 3; then resumed (in this process, on this module's Ray): each step logged once."""
    from fault_helpers import run_args

    run = tmp_path / "run"
    args = run_args(model_dir, run, "train.steps=4", "checkpoint.every=2", "distributed.rollout_workers=1",
                    "distributed.sync_timeout=120")
    _killed_whole_at(args, tmp_path / "held-update", "update@3:hold")
    assert step_numbers(run) == [1, 2]
    _killed_whole_at(["run", "--resume", str(run)], tmp_path / "held-sync", "sync@3:hold")
    assert step_numbers(run) == [1, 2]
    loop.train(None, resume=run)  # what `rldsl run --resume RUN` runs
    assert step_numbers(run) == [1, 2, 3, 4]
    assert sorted({s["step"] for s in samples_of(run)}) == [1, 2, 3, 4]
