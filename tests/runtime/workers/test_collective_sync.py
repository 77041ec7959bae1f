"""``distributed.weight_sync = "collective"``: trainer rank 0 broadcasts the weights bucket by
bucket over a process group made for the sync (gloo here) to every rollout worker, which loads
them in place; every sync leaves each engine equal to the trainers' weights, bit for bit in
float32. A stuck sync fails within ``distributed.sync_timeout``, naming its side and bucket.

Setup as test_ray.py (its cluster, config and reward): a tiny random Llama, 2 trainer ranks
(FSDP2 over gloo) and 2 rollout workers (hf engine), buckets of 0.01 MiB (several per sync).
"""
from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch

from rldsl.runtime.errors import WeightSyncError
from rldsl.runtime.run import step as run_step
from rldsl.runtime.workers.sync.buckets import Entry, SyncGroup, bucket_bytes, receive_buckets

from test_ray import config, ray_cluster  # noqa: F401 - the module's fixtures

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_collective_sync_leaves_every_engine_equal_to_the_trainers(ray_cluster, model_dir, tmp_path):
    from rldsl.runtime.run.build import build_run
    out = tmp_path / "run"
    out.mkdir()
    cfg = config(model_dir, out, 2, 2, **{"distributed.weight_sync": "collective",
                                          "distributed.sync_bucket_mb": 0.01, "checkpoint.every": 0})
    s = build_run("grpo", cfg, out)
    try:
        assert s.trainers.weights() is s.trainers.sync
        syncs = []
        for step in range(2):
            m = run_step.train_step(s, step)
            trainer = s.trainers.checkpoint_state().policy.state_dict()
            engines = ray.get([a.engine_weights.remote() for a in s.rollouts.actors])
            syncs.append((m, trainer, engines))
        plan = ray.get(s.trainers.actors[0].sync_plan.remote(int(0.01 * 2**20)))
    finally:
        s.close()
    assert len(plan) > 3  # several buckets per sync
    base = None
    for m, trainer, engines in syncs:
        assert m["time/sync_s"] > 0
        names = [n for bucket in plan for n, _, _ in bucket]
        assert m["sync/bytes"] == sum(trainer[n].numel() * trainer[n].element_size() for n in names)
        for engine in engines:
            common = engine.keys() & trainer.keys()
            assert len(common) >= len(trainer) - 1  # (lm_head may be tied to the embedding)
            for k in common:
                assert engine[k].dtype == torch.float32
                assert torch.equal(engine[k], trainer[k]), k
        if base is not None:  # the update changed the weights, and the engines followed
            assert any(not torch.equal(trainer[k], base[k]) for k in trainer)
        base = trainer


def _pair(timeout: float, generation: int) -> tuple[SyncGroup, SyncGroup]:
    """A weight-sync group of two in this process: the trainer (rank 0) and one rollout worker."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    groups: dict[int, SyncGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = SyncGroup("127.0.0.1", port, rank, 2, timeout, torch.device("cpu"), generation,
                                 "trainer rank 0" if rank == 0 else "rollout worker 0",
                                 listen_fd=listener.fileno() if rank == 0 else None)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return groups[0], groups[1]


def test_a_stuck_sync_fails_within_sync_timeout_naming_side_and_bucket():
    plan = [[Entry("a.weight", (4, 4), "torch.float32", ())], [Entry("b.weight", (8,), "torch.float16", ())]]
    sent = [torch.arange(16, dtype=torch.float32).view(4, 4), torch.arange(8, dtype=torch.float16)]
    # the trainer stops after bucket 1: the rollout worker fails at bucket 2
    trainer, worker = _pair(1.0, 1)
    got: list = []
    t = threading.Thread(target=lambda: trainer.broadcast(sent[0].view(-1).view(torch.uint8).clone(), "bucket 1"))
    t.start()
    with pytest.raises(WeightSyncError, match=r"rollout worker 0: .*bucket 2 of 2 \(b\.weight"):
        for name, tensor in receive_buckets(worker, plan):
            got.append((name, tensor.clone()))
    t.join()
    assert [n for n, _ in got] == ["a.weight"] and torch.equal(got[0][1], sent[0])
    # the rollout worker stops after bucket 1: the trainer fails at bucket 2, within the timeout
    trainer, worker = _pair(1.0, 2)
    t = threading.Thread(target=lambda: next(receive_buckets(worker, plan)))
    t.start()
    trainer.broadcast(sent[0].view(-1).view(torch.uint8).clone(), "bucket 1 of 2")
    t.join()
    start = datetime.datetime.now()
    with pytest.raises(WeightSyncError, match=r"trainer rank 0: .*bucket 2 of 2 .*sync_timeout=1 s"):
        trainer.broadcast(torch.zeros(bucket_bytes(plan[1]), dtype=torch.uint8), "bucket 2 of 2")
    assert (datetime.datetime.now() - start).total_seconds() < 10


def test_collective_sync_is_refused_where_it_cannot_run():
    """One process (no rollout worker to broadcast to) and an asynchronous run (it loads
    published older versions) are refused from the config alone, exit code 2."""
    import rldsl
    from rldsl.runtime.config import load_config
    from rldsl.runtime.errors import ConfigError
    from rldsl.runtime.resolve import check_settings

    grpo = rldsl.load("grpo")
    check_settings(grpo, load_config(None, ["distributed.weight_sync=collective", "distributed.rollout_workers=2"]))
    check_settings(grpo, load_config(None, ["distributed.rollout_workers=1", "rollout.max_staleness=1"]))  # auto
    with pytest.raises(ConfigError, match="rollout_workers >= 1") as e:
        check_settings(grpo, load_config(None, ["distributed.weight_sync=collective"]))
    assert e.value.exit_code == 2
    with pytest.raises(ConfigError, match="max_staleness=1"):
        check_settings(grpo, load_config(None, ["distributed.weight_sync=collective", "distributed.rollout_workers=1",
                                                "rollout.max_staleness=1"]))


def test_auto_picks_the_collective_sync_only_where_it_was_measured_faster_and_is_tested():
    from rldsl.runtime.config import load_config
    from rldsl.runtime.workers.sync.transports import transport_name

    def path(*sets: str) -> str:
        return transport_name(load_config(None, ["distributed.rollout_workers=1", *sets]))

    assert path() == "collective"
    for other in (["rollout.max_staleness=1"], ["rollout.engine=vllm"], ["model.lora.rank=4"], ["device=cuda"]):
        assert path(*other) == "object_store", other
    assert path("distributed.weight_sync=object_store") == "object_store"
    assert path("device=cuda", "distributed.weight_sync=collective") == "collective"


@pytest.mark.parametrize("first", ["the trainer's broadcast", "the worker's death"])
def test_a_worker_killed_mid_sync_is_named_whichever_failure_the_driver_hears_first(first):
    """A rollout worker killed mid-broadcast: the trainer's broadcast fails too, and which of the
    two the driver hears first is a race. The restart's message names the dead worker either way
    (CI heard the trainer first once, and the message said the trainer failed)."""
    from types import SimpleNamespace

    from rldsl.runtime.config import load_config
    from rldsl.runtime.errors import WorkerError
    from rldsl.runtime.workers.sync.collective import CollectiveSync

    def wait(calls, timeout, what):
        if first == "the worker's death":
            err = WorkerError(f"rollout worker 0 died during {what}: killed")
            err.died = "rollout worker 0"
        else:
            err = WorkerError(f"trainer rank 0 failed during {what}: WeightSyncError: bucket 1 of 2")
        raise err

    stub = SimpleNamespace(remote=lambda *a: None)
    sync = CollectiveSync(SimpleNamespace(wait=wait), load_config(None, []), [SimpleNamespace(sync_send=stub)], True)
    sync.formed = True
    sync._dead_worker = lambda rollouts: "rollout worker 0"  # the liveness check after the failure
    said = []
    rollouts = SimpleNamespace(names=["rollout worker 0"], actors=[SimpleNamespace(sync_receive=stub)],
                               _restarted=lambda w, why: said.append((w, why)))
    sync.push(rollouts, 1, 1)
    assert said and said[0][0] == 0 and said[0][1].startswith("rollout worker 0 died during the weight sync")


def test_the_collective_sync_of_lora_adapters_sends_the_adapters_alone(tiny_model):
    """model.lora.sync='adapter' over the collective path: the plan holds the adapter tensors alone
    (nothing merged, no base weight), the trainer broadcasts them bucket by bucket and the rollout
    side rebuilds the trainer's adapters exactly (what its engine's load_adapter gets)."""
    import copy

    pytest.importorskip("peft")
    from rldsl.runtime.models.lora import adapter_of, apply_lora
    from rldsl.runtime.workers.sync.buckets import as_adapter, as_plain, from_plain, plan_bytes, send_buckets, sync_plan

    policy, _ = apply_lora(copy.deepcopy(tiny_model), rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    for name, p in policy.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p, std=0.1)
    expected = adapter_of(policy)
    plan = sync_plan(policy, 4096, adapters=True)
    assert len(plan) > 1 and sorted(e.name for b in plan for e in b) == sorted(expected.tensors)
    assert plan_bytes(plan) == expected.nbytes  # fp32 tensors: no padding
    full = sync_plan(policy, 4096)
    assert not any(".lora_" in e.name for b in full for e in b) and plan_bytes(full) > 5 * plan_bytes(plan)
    trainer, worker = _pair(30.0, 1)
    sent: list = []
    t = threading.Thread(target=lambda: sent.append(send_buckets(policy, plan, trainer, torch.device("cpu"))))
    t.start()
    got = as_adapter(receive_buckets(worker, from_plain(as_plain(plan))), 4, 8.0)
    t.join()
    assert sent == [(expected.nbytes, None)]
    assert got.tensors.keys() == expected.tensors.keys() and (got.rank, got.alpha) == (4, 8.0)
    assert all(torch.equal(got.tensors[k], v) for k, v in expected.tensors.items())
