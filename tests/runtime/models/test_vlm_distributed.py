"""A vision-language policy on the distributed runtime (local Ray cluster, CPU, gloo; the tiny
random Qwen2-VL of tests/fixtures/vlm_model.py): FSDP2 over 2 trainer ranks computes what one
process computes (each rank's forwards get the pixel values of its own rows), and a Ray rollout
worker's engine samples what the driver's engine samples (the prompts' images travel with the
request as their paths and data: URLs)."""
from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import pytest

import vlm_model as fixture

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for the module (as tests/runtime/workers/test_ray.py's)."""
    import logging
    import shutil
    import tempfile
    tmp = tempfile.mkdtemp(prefix="rldsl-ray-", dir="/tmp")  # short: Ray's socket paths
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", _temp_dir=tmp, logging_level=logging.WARNING)
    yield
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def vlm_data(folder: Path, n: int) -> Path:
    """``n`` chats with one or two images each (one of them a data: URL), of different sizes (so
    the rows' pixel values differ in length)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(exist_ok=True)
    rows = []
    for i in range(n):
        path = folder / "images" / f"{i:04d}.png"
        fixture.image(i, (56 + 28 * (i % 3), 56)).save(path)
        parts = [{"type": "image", "image": f"images/{i:04d}.png"}]
        if i % 2:
            parts.append({"type": "image", "image": "data:image/png;base64,"
                          + base64.b64encode(path.read_bytes()).decode()})
        rows.append({"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Colour?"}]},
                                  {"role": "assistant", "content": "red"}]})
    out = folder / "train.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _config(folder: Path, data: Path, out: Path, **over):
    from rldsl.runtime.config import load_config
    sets = [f"model.path={folder}", f"data.path={data}", f"out={out}", "rollout.prompts_per_step=2", "rollout.n=4",
            "rollout.max_new_tokens=5", "train.steps=2", "data.eval_size=0", "eval.every=0", "checkpoint.every=0",
            "log.progress=false", "reward.name=reward_helpers:parity", "train.lr=1e-2", "train.minibatches=2",
            "distributed.sync_timeout=120", "distributed.collective_timeout=120"]
    return load_config(None, sets + [f"{k}={v}" for k, v in over.items()])


def _steps(run: Path) -> list[dict]:
    from rldsl.runtime.records.metrics import read_metrics
    return [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]


@pytest.fixture(scope="module")
def one_process(vlm_model, tmp_path_factory):
    """The reference: the same run in one process (no Ray)."""
    from rldsl.runtime.run import loop
    tmp = tmp_path_factory.mktemp("vlm-dist")
    data = vlm_data(tmp / "data", 4)
    return data, _steps(loop.train("grpo", _config(vlm_model, data, tmp / "one")))


def _same(one: list[dict], other: list[dict]) -> None:
    assert [r["step"] for r in one] == [r["step"] for r in other] == [1, 2]
    assert any(r["optimizer_steps"] > 0 for r in one)
    for a, b in zip(one, other):
        assert a["reward_mean"] == b["reward_mean"]  # the same samples
        for k in ("loss", "pg_loss", "grad_norm", "kl"):
            if k in a:
                assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-5), (k, a[k], b[k])


@pytest.mark.slow
def test_two_fsdp_trainer_ranks_equal_one_process(ray_cluster, vlm_model, one_process, tmp_path):
    """FSDP2 over 2 gloo trainer ranks (Ray actors): the driver's engine samples, the rollout (its
    prompts carrying their image refs) travels to the ranks, each rank's old, reference and update
    forwards get the pixel values of its own groups' rows only; rewards, losses and grad norms
    equal the one-process run's."""
    from rldsl.runtime.run import loop
    data, one = one_process
    two = _steps(loop.train("grpo", _config(vlm_model, data, tmp_path / "two", **{"distributed.trainers": 2})))
    _same(one, two)


@pytest.mark.slow
def test_a_ray_rollout_worker_samples_with_the_images(ray_cluster, vlm_model, one_process, tmp_path):
    """One Ray rollout worker (its own HF engine in an actor, the weights synced to it every step):
    the prompts reach it with their images' paths and data: URLs and it samples what the driver's
    engine samples in one process (without the images it would sample something else)."""
    from rldsl.runtime.run import loop
    data, one = one_process
    worker = _steps(loop.train("grpo", _config(vlm_model, data, tmp_path / "worker",
                                               **{"distributed.rollout_workers": 1})))
    _same(one, worker)
