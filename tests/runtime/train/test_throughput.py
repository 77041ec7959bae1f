"""Throughput metrics: the FLOP count by hand, the peak table, and the step's perf/* metrics."""
from __future__ import annotations

import math

import pytest
import torch

from rldsl.runtime.records.metrics import MFU, PADDING_RATIO, TOKEN_IMBALANCE, UPDATE_TOKENS_PER_S, throughput
from rldsl.runtime.train import throughput as tp
from rldsl.runtime.train.throughput import ModelDims, TokenCount, peak_flops


def test_model_dims_count_the_linear_weights_by_hand(tiny_model, tokenizer) -> None:
    h, i, L, V = 32, 64, 2, len(tokenizer)
    cfg = tiny_model.config
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)  # key/value width
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i  # q, k, v, o, gate/up/down
    dims = ModelDims.of(tiny_model)
    assert dims.layers == L and dims.attention == h
    assert dims.linear == L * per_layer + V * h  # the LM head once (the embedding lookup is no matmul)


def test_flops_forward_and_backward() -> None:
    c = TokenCount()
    c.add([3, 5], computed=10)
    c.add([4], computed=4)
    assert (c.real, c.computed, c.padding, c.square, c.per_forward) == (12, 14, 2, 9 + 25 + 16, [8, 4])
    dims = ModelDims(linear=100, layers=2, attention=8)
    fwd = 2 * 100 * 12 + 4 * 8 * 2 * 50
    assert c.model_flops(dims, backward=False) == fwd
    assert c.model_flops(dims, backward=True) == 3 * fwd


def test_peak_from_config_gpu_table_or_cpu_rate(monkeypatch) -> None:
    assert peak_flops("cpu", None, 5e9) == 5e9
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops("cuda", torch.bfloat16, None) == 989e12
    assert peak_flops("cuda", None, None) == 67e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 PCIe")
    assert peak_flops("cuda", torch.bfloat16, None) == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Some Future GPU")
    assert math.isnan(peak_flops("cuda", torch.bfloat16, None))
    rate = tp.cpu_matmul_rate(torch.get_num_threads(), size=64, seconds=0.01)
    assert rate > 1e6


def test_measuring_the_cpu_rate_leaves_the_global_rng_alone() -> None:
    """Measured once per process, in the first step: a resumed process measures again, so a draw
    from the global RNG would move the RNG state the run checkpoints and restores."""
    tp.cpu_matmul_rate.cache_clear()
    torch.manual_seed(5)
    tp.cpu_matmul_rate(1, size=8, seconds=0.001)
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), after)


def test_the_one_thread_cpu_rate_does_not_count_time_lost_to_other_processes(monkeypatch) -> None:
    """Each product costs 0.5 ms of this thread's CPU, while the wall clock jumps 1 s (the thread
    was preempted by other processes): the peak is the CPU-time rate, not the wall-time one (on a
    busy machine the wall-time peak was a fraction of the real one: an MFU above 1)."""
    cpu, wall = [0.0], [0.0]

    def thread_time() -> float:
        cpu[0] += 0.0005  # read before and after each product
        return cpu[0]

    def perf_counter() -> float:
        wall[0] += 1.0
        return wall[0]

    monkeypatch.setattr(tp.time, "thread_time", thread_time)
    monkeypatch.setattr(tp.time, "perf_counter", perf_counter)
    tp.cpu_matmul_rate.cache_clear()
    try:
        rate = tp.cpu_matmul_rate(1, size=8, seconds=0.5, tries=3)
    finally:
        tp.cpu_matmul_rate.cache_clear()
    assert rate == pytest.approx(2 * 8 ** 3 / 0.0005)


def test_step_metrics_from_counts() -> None:
    m = {"time/rollout_s": 2.0, "time/logprobs_s": 1.0, "time/update_s": 3.0,
         "perf/logprobs_tokens": 100.0, "perf/logprobs_computed_tokens": 150.0,
         "perf/logprobs_padding_tokens": 50.0, "perf/logprobs_flops": 1e9,
         "perf/update_tokens": 100.0, "perf/update_computed_tokens": 150.0,
         "perf/update_padding_tokens": 50.0, "perf/update_flops": 3e9,
         "perf/update_token_imbalance": 1.25, "perf/update_microbatch_imbalance": 1.5}
    out = throughput(m, peak_flops=1e9, generated_tokens=40.0)
    assert out["perf/rollout_tokens_per_s"] == 20.0
    assert out["perf/logprobs_tokens_per_s"] == 100.0
    assert out[UPDATE_TOKENS_PER_S] == pytest.approx(100.0 / 3)
    assert out[PADDING_RATIO] == pytest.approx(100.0 / 300.0)
    assert out[MFU] == pytest.approx(4e9 / 4.0 / 1e9)
    assert out[TOKEN_IMBALANCE] == 1.25 and out["perf/microbatch_imbalance"] == 1.5
    skipped = throughput({"time/rollout_s": 1.0}, 1e9, 10.0)  # no forwards: only the rollout rate
    assert set(skipped) == {"perf/rollout_tokens_per_s"}


def test_a_discarded_copy_counts_as_padding() -> None:
    c = TokenCount()
    c.add([3, 5], computed=10)
    total = TokenCount()
    total.merge(c, ModelDims(100, 2, 8), backward=True, waste=True)
    assert (total.real, total.computed, total.padding, total.flops, total.per_forward) == (0, 10, 10, 0.0, [])
