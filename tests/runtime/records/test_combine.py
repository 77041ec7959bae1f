"""How an update's metrics combine over micro-batches, minibatches, epochs and ranks: one kind per
metric (records/metrics.py COMBINE), applied alike at every level; the ranks' all-reduce on two
gloo processes (workers/fsdp.py), moe/* included."""
from __future__ import annotations

import json
import os
import socket
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rldsl.runtime.models.moe import RoutingStats
from rldsl.runtime.records.metrics import (MAX, MEAN, MIN, ROWS, SUM, TERM, TOKENS, combine, combine_kind,
                                           combine_ranks)


def test_each_metric_declares_its_kind() -> None:
    assert [combine_kind(k) for k in ("loss", "pg_loss", "value_loss", "distill/loss")] == [TERM] * 4
    assert combine_kind("grad_norm") == MEAN
    assert combine_kind("optimizer_steps") == SUM
    assert [combine_kind(k) for k in ("ratio_max", "correction/is_max", "distill/teacher_mass_max")] == [MAX] * 3
    assert [combine_kind(k) for k in ("ratio_min", "correction/is_min")] == [MIN] * 2
    assert combine_kind("correction/rejected_seq_fraction") == ROWS
    assert [combine_kind(k) for k in ("entropy", "clip_fraction", "kl", "moe/aux_loss")] == [TOKENS] * 4


# two pieces: (metrics, loss-mask tokens, rows)
PIECES = [({"loss": 1.0, "ratio_max": 2.0, "ratio_min": 0.5, "kl": 1.0, "grad_norm": 4.0,
            "optimizer_steps": 1.0, "correction/rejected_seq_fraction": 0.5}, 1.0, 2.0),
          ({"loss": 2.0, "ratio_max": 3.0, "ratio_min": 0.7, "kl": 4.0, "grad_norm": 6.0,
            "optimizer_steps": 1.0, "correction/rejected_seq_fraction": 0.0}, 3.0, 1.0)]


def test_pieces_of_a_minibatch_combine_by_kind() -> None:
    assert combine(PIECES) == {"loss": 3.0,                 # term: parts of one denominator add up
                               "ratio_max": 3.0, "ratio_min": 0.5,
                               "kl": (1.0 * 1 + 4.0 * 3) / 4,  # tokens: 3.25
                               "grad_norm": 5.0, "optimizer_steps": 2.0,
                               "correction/rejected_seq_fraction": (0.5 * 2 + 0.0 * 1) / 3}


def test_minibatches_and_epochs_combine_by_the_same_kinds() -> None:
    out = combine(PIECES, whole=True)
    assert out["loss"] == 1.5  # each minibatch's loss is whole: averaged
    # the extremes stay extremes over minibatches (they were averaged: 2.5 and 0.6)
    assert (out["ratio_max"], out["ratio_min"]) == (3.0, 0.5)
    assert out["kl"] == 3.25 and out["optimizer_steps"] == 2.0 and out["grad_norm"] == 5.0


def test_ratio_extremes_over_minibatches_and_epochs(tiny_model, tokenizer) -> None:
    """The M2PO finding: with 2 minibatches and 2 epochs the step's ratio_max is the largest
    minibatch's, not their mean."""
    import rldsl
    from rldsl.runtime.config import RunConfig
    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.rollout.engines.hf import HFEngine
    from rldsl.runtime.train.trainer import Trainer
    from pathlib import Path
    cfg = RunConfig()
    cfg.train.ppo_epochs = 2
    cfg.train.minibatches = 2
    cfg.train.skip_zero_advantage = False
    fn = rldsl.compile(rldsl.load(str(Path(__file__).parents[3] / "algorithms" / "grpo.rl")), compile=False)
    trainer = Trainer.from_config(cfg, fn, tiny_model)
    trainer.optimizer = torch.optim.SGD(tiny_model.parameters(), lr=2.0)  # large steps: ratios move
    rollout = HFEngine(tiny_model, tokenizer).generate(
        ["1+2=", "33+44=", "9=", "12*3="], SamplingParams(n=2, temperature=1.5, max_new_tokens=6, seed=0))
    batch = trainer.estimate(rollout, torch.tensor([1.0, 0.0] * 4))
    seen: list[dict[str, float]] = []
    step = trainer._step

    def recorded(*a, **k):
        m = step(*a, **k)
        if m is not None:
            seen.append(dict(m))
        return m

    trainer._step = recorded  # type: ignore[method-assign]
    out = trainer.update(batch, torch.Generator().manual_seed(0))
    assert len(seen) == 4 and out["optimizer_steps"] == 4.0
    assert len({m["ratio_max"] for m in seen}) > 1  # the minibatches differ: a mean would not be the max
    assert out["ratio_max"] == max(m["ratio_max"] for m in seen)
    assert out["ratio_min"] == min(m["ratio_min"] for m in seen)
    assert out["loss"] == pytest.approx(sum(m["loss"] for m in seen) / 4)


# ----------------------------------------------------------------------------- two gloo ranks

# each rank's (metrics, rows of 2 loss-mask tokens, share)
RANK_METRICS = [({"loss": 0.25, "ratio_max": 1.5, "ratio_min": 0.9, "kl": 2.0, "grad_norm": 7.0,
                  "correction/rejected_seq_fraction": 1.0}, 3, 1.0),
                ({"loss": 0.5, "ratio_max": 1.77, "ratio_min": 0.95, "kl": 5.0, "grad_norm": 7.0,
                  "correction/rejected_seq_fraction": 0.0}, 1, 1.0)]


def _rank(rank: int, port: int, out: str) -> None:
    from rldsl.runtime.workers.fsdp import ShardedTrainer
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        me = types.SimpleNamespace(device=torch.device("cpu"))
        me._reduce_floats = types.MethodType(ShardedTrainer._reduce_floats, me)
        metrics, rows, share = RANK_METRICS[rank]
        mask = torch.zeros(4, 2)
        mask[:rows] = 1.0  # rank 0: 3 rows, 6 tokens; rank 1: 1 row, 2 tokens
        got = ShardedTrainer._reduce_metrics(me, metrics, mask, share)
        # a rank without rows (share 0) counts for nothing but its mean-kind values
        idle = ShardedTrainer._reduce_metrics(me, metrics, mask, share if rank == 0 else 0.0)
        stats = RoutingStats(recorded=10 * (rank + 1), mismatched=rank * 5, drift=1,
                             counts=[torch.tensor([3.0, 1.0]) if rank == 0 else torch.tensor([0.0, 4.0])],
                             aux_total=float(rank + 1), aux_calls=1)
        moe = ShardedTrainer._every_rank_routing(me, stats).metrics()
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump({"got": got, "idle": idle, "moe": moe}, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_combine_by_kind_moe_included(tmp_path) -> None:
    mp.start_processes(_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert results[0] == results[1]  # every rank has the whole minibatch's values
    got, idle, moe = results[0]["got"], results[0]["idle"], results[0]["moe"]
    assert got["loss"] == 0.75                                     # term: summed
    assert (got["ratio_max"], got["ratio_min"]) == (1.77, 0.9)     # extremes over ranks
    assert got["kl"] == pytest.approx((2.0 * 6 + 5.0 * 2) / 8)     # tokens-weighted
    assert got["correction/rejected_seq_fraction"] == pytest.approx(3 / 4)  # rows-weighted
    assert got["grad_norm"] == 7.0                                 # mean (alike on each rank)
    assert idle["loss"] == 0.25 and idle["ratio_max"] == 1.5 and idle["kl"] == 2.0 and idle["grad_norm"] == 7.0
    # moe/*: ratios of the counts summed over the ranks, not rank 0's share
    assert moe["moe/routing_mismatch"] == pytest.approx(5 / 30)
    assert moe["moe/router_drift"] == pytest.approx(2 / 30)
    assert moe["moe/aux_loss"] == pytest.approx(3 / 2)
    assert moe["moe/expert_load_max"] == pytest.approx(5 / 4)     # counts [3, 5]: 5 / mean 4
