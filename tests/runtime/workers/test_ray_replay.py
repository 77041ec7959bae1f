"""``sampling replay`` on Ray: the buffer lives on the driver, where the step is assembled
(run/step_batch.py); two FSDP2 trainer ranks (gloo, CPU) train the batch with its replayed
groups exactly as one process does, and a run stopped after a checkpoint resumes to the same
weights. Setup as tests/runtime/workers/test_ray.py: the tiny model, P = 4 x G = 4, mixed rewards."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rldsl.runtime.config import RunConfig, load_config
from rldsl.runtime.records import checkpoint as ckpt
from rldsl.runtime.records.metrics import read_metrics
from rldsl.runtime.run import loop
from local_ray import local_ray

ray = pytest.importorskip("ray")

TOL = 1e-5
#: substitute the step's non-informative groups, drawn by TRL's priority
SPEC = '''algorithm grpo_replay extends grpo
  sampling      replay(capacity=4, priority="std * sum(abs(adv))", max_age=2)
'''
#: the same, keeping each group's advantage of its first training (under batch_std it differs
#: from the recomputed one): the driver asks rank 0 for the advantages it keeps
KEEP = SPEC.replace("max_age=2)", "max_age=2, advantage=keep)\n  normalizer    batch_std")


def coarse_reward(prompt: str, completion: str, answer: str) -> float:
    """0 or 1 from the completion's characters: groups of equal rewards happen (for replay to
    substitute) beside mixed ones (to enter the buffer)."""
    return float(sum(map(ord, completion)) % 4 == 0)


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(4):
        yield


def config(model_dir: Path, out: Path, trainers: int = 1, workers: int = 0, **over) -> RunConfig:
    sets = [f"model.path={model_dir}", f"out={out}", "rollout.prompts_per_step=4", "rollout.n=4",
            "train.steps=3", "data.eval_size=0", "checkpoint.every=1", "checkpoint.keep_last=0",
            "log.progress=false", f"reward.name={__name__}:coarse_reward",
            f"distributed.trainers={trainers}", f"distributed.rollout_workers={workers}",
            "distributed.sync_timeout=120", "distributed.collective_timeout=120"]
    return load_config(None, sets + [f"{k}={v}" for k, v in over.items()])


def steps_of(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]


def params(run: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(run / "checkpoints" / f"step-{step}" / "policy" / "model.safetensors"))


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= TOL, f"parameters differ by {worst:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("text", [SPEC, KEEP], ids=["recompute", "keep"])
def test_replay_on_two_trainer_ranks_matches_one_process_and_resumes(ray_cluster, model_dir, tmp_path, text):
    spec = tmp_path / "replay.rl"
    spec.write_text(text, encoding="utf-8")
    one = loop.train(str(spec), config(model_dir, tmp_path / "one"))
    two = loop.train(str(spec), config(model_dir, tmp_path / "two", trainers=2, workers=1))
    a, b = steps_of(one), steps_of(two)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert any(r["replay/age"] > 0 for r in a), "some step replays a group of an earlier step"
    for ra, rb in zip(a, b):
        for k in ("reward_mean", "replay/size", "replay/fraction", "replay/age"):
            assert ra[k] == rb[k], k  # the same samples, buffer and draws on the driver
        for k in ("loss", "pg_loss", "grad_norm", "clip_fraction", "replay/ratio_mean", "replay/ratio_min",
                  "replay/ratio_max"):
            if k in ra or k in rb:
                assert math.isclose(ra[k], rb[k], rel_tol=1e-4, abs_tol=TOL), (k, ra[k], rb[k])
    for step in (1, 2, 3):
        assert_close(params(one, step), params(two, step))
    if text != KEEP:  # a resumed buffer on Ray once, the kept advantages included (the recomputing
        return        # spec's resume: tests/runtime/run/test_replay.py, tests/faults/test_replay_kill.py)
    # stopped after its step-2 checkpoint (the buffer in it) and resumed on the same two ranks
    cut = loop.train(str(spec), config(model_dir, tmp_path / "cut", trainers=2, workers=1), stop_after=2)
    assert ckpt.latest_checkpoint(cut).name == "step-2"
    assert "replay" in ckpt.load_checkpoint(ckpt.latest_checkpoint(cut)).extra
    loop.train(str(spec), resume=cut)
    c = steps_of(cut)
    assert [r["step"] for r in c] == [1, 2, 3]
    for k in ("reward_mean", "replay/size", "replay/fraction", "replay/age"):
        assert c[2][k] == b[2][k], k
    assert_close(params(two, 3), params(cut, 3))


@pytest.mark.slow
def test_an_agents_replay_on_two_trainer_ranks_matches_one_process(ray_cluster, model_dir, tmp_path):
    """rollout.agent (tests/runtime/agent_helpers.py ``odd_answers_break``: one row per episode or
    two) run by a Ray rollout worker, the buffer on the driver, two FSDP2 ranks: the groups of
    episodes kept and drawn are the one-process run's, and so are the losses, replayed ratios and
    weights."""
    pytest.importorskip("openai")
    spec = tmp_path / "replay.rl"
    spec.write_text(SPEC, encoding="utf-8")
    over = {"rollout.agent": "agent_helpers:odd_answers_break", "rollout.agent_concurrency": 1,
            "rollout.prompts_per_step": 2, "rollout.n": 2, "rollout.max_new_tokens": 3, "train.steps": 4}
    one = loop.train(str(spec), config(model_dir, tmp_path / "one", **over))
    two = loop.train(str(spec), config(model_dir, tmp_path / "two", trainers=2, workers=1, **over))
    a, b = steps_of(one), steps_of(two)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert any(r["replay/fraction"] > 0 for r in a), "some step replays a group"
    assert max(r["agent/rows_per_episode"] for r in a) > 1.0, "episodes of two rows"
    for ra, rb in zip(a, b):
        for k in ("reward_mean", "agent/rows_per_episode", "replay/size", "replay/fraction", "replay/age"):
            assert ra[k] == rb[k], k
        for k in ("loss", "pg_loss", "grad_norm", "replay/ratio_mean", "replay/ratio_min", "replay/ratio_max"):
            if k in ra or k in rb:
                assert math.isclose(ra[k], rb[k], rel_tol=1e-4, abs_tol=TOL), (k, ra[k], rb[k])
    for step in (1, 2, 3, 4):
        assert_close(params(one, step), params(two, step))
