"""bench/overhead.py's clock (each phase its own time, less the phases nested in it) and its
refusals before any run starts (usage errors exit 2). Runs no benchmark."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def overhead():
    spec = importlib.util.spec_from_file_location("overhead", ROOT / "bench" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_clock_counts_each_phase_less_the_phases_inside_it(overhead, monkeypatch) -> None:
    now = [0.0]  # a clock that moves only when the code under test "works"
    monkeypatch.setattr(overhead.time, "perf_counter", lambda: now[0])
    clock = overhead.Clock()

    class Box:
        def inner(self):
            now[0] += 2.0

        def outer(self):
            now[0] += 1.0
            self.inner()
            self.inner()  # a part called twice: both calls counted

        def again(self):
            return self.outer()  # the same phase re-entered: counted once, by the outer entry
    box = Box()
    clock.wrap(box, "inner", "forward", within="update")
    clock.wrap(box, "outer", "update")
    clock.wrap(box, "again", "update")
    box.inner()  # outside "update": not a part of it, not timed
    assert clock.host == {}
    box.again()
    assert clock.host == {"forward": 4.0, "update": 1.0}  # the update: its own time only
    clock.reset()
    assert clock.host == {}


@pytest.mark.parametrize("argv,says", [
    (["--steps", "2", "--warmup", "3"], "--steps must exceed --warmup"),
    (["--device", "cuda", "--rldsl-only"], "needs a GPU"),
])
def test_usage_errors_exit_2_before_any_run(overhead, monkeypatch, capsys, argv, says) -> None:
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["overhead.py", *argv])
    with pytest.raises(SystemExit) as exc:
        overhead.main()
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_spread_is_the_p10_p90_range_over_the_median(overhead) -> None:
    xs = [1.0] * 8 + [1.5, 0.5]
    assert overhead.spread(xs) == pytest.approx((1.5 - 1.0) / 1.0)
    assert overhead.spread([1.0] * 10) == 0.0


def test_rounds_alternate_the_sides_in_abba_order(overhead) -> None:
    """A load drifting over the run falls on both sides alike: TRL leads in even rounds only."""
    order = [side for k in range(4) for side in overhead.round_sides(k)]
    assert order == ["trl", "rldsl", "rldsl", "trl", "trl", "rldsl", "rldsl", "trl"]
    assert overhead.round_sides(1, rldsl_only=True) == ("rldsl",)



def test_kernels_and_waits_go_to_the_innermost_phase_holding_their_launch(overhead) -> None:
    """--device cuda's accounting (no GPU here: stand-in events of the profiler's shape): a
    kernel counts once, in the innermost phase whose range holds the op that launched it (also
    an op of another thread, as the autograd engine's backward), outside every range in
    ``between``; the runtime's blocking calls are the phase's time blocked on the GPU."""
    from types import SimpleNamespace as NS

    def ev(name, start, end, *kernel_us):
        return NS(name=name, time_range=NS(start=start, end=end, elapsed_us=lambda: end - start),
                  kernels=[NS(duration=k) for k in kernel_us])
    tag = overhead.PHASE_TAG
    events = [ev(tag + "update", 0, 100), ev(tag + "forward", 10, 40), ev(tag + "backward", 50, 90),
              ev("aten::mm", 12, 14, 300.0, 200.0),  # two kernels of one op in the forward
              ev("aten::add", 45, 46, 7.0),  # the update's own code, between its parts
              ev("autograd::engine::evaluate_function: MmBackward0", 60, 61, 900.0),  # another thread
              ev("cudaStreamSynchronize", 80, 89),  # blocked in the backward
              ev("cudaMemcpyAsync", 95, 99),  # a copy back to the host, in the update
              ev("cudaLaunchKernel", 13, 13.5),  # a launch: neither kernel time nor a wait
              ev("aten::mul", 120, 121, 5.0)]  # after every phase
    kernels, waits = overhead.Clock.finish(events)
    assert kernels == pytest.approx({"forward": 500e-6, "update": 7e-6, "backward": 900e-6, "between": 5e-6})
    assert waits == pytest.approx({"forward": 0.0, "update": 4e-6, "backward": 9e-6, "between": 0.0})
    cuda, blocked = overhead.step_cuda(kernels, waits)
    assert cuda["other"] == pytest.approx(7e-6) and cuda["update"] == pytest.approx(1407e-6)
    assert blocked["update"] == pytest.approx(13e-6)


def test_the_clock_opens_a_profiler_range_per_phase_entry(overhead) -> None:
    """With cuda, the clock's ranges are in the real profiler's trace and nest as the phases
    do: an op in the forward is the forward's, one in the update outside it the update's."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    clock = overhead.Clock(cuda=True)
    x = torch.ones(4, 4)

    class Box:
        def forward(self):
            return x @ x

        def update(self):
            self.forward()
            return x @ x
    box = Box()
    clock.wrap(box, "forward", "forward", within="update")
    clock.wrap(box, "update", "update")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        box.update()
        x @ x
    events = prof.events()
    ranges = overhead.phase_ranges(events)
    assert sorted(r[0] for r in ranges) == ["forward", "update"]
    ops = [(e.time_range.start, 1.0, 0.0) for e in events if e.name == "aten::mm"]
    assert overhead.attribute(ranges, ops)[0] == {"forward": 1.0, "update": 1.0, "between": 1.0}
    assert set(clock.host) == {"forward", "update"}


def test_the_cuda_report_prints_host_busy_over_cuda(overhead, capsys) -> None:
    """The step's host busy time (host less blocked) over every kernel of the step."""
    phases = (*overhead.PHASES, *overhead.UPDATE_PARTS)
    host = {p: 0.0 for p in phases} | {"update": 0.3, "forward": 0.3, "rollout": 0.1}
    cuda = {p: 0.0 for p in phases} | {"update": 0.4, "forward": 0.4, "rollout": 0.2, "between": 0.2}
    blocked = {"update": 0.2, "forward": 0.2}
    st = {"step_s": 0.4, "host": host, "cuda": cuda, "blocked": blocked, "floors": {p: 1.0 for p in phases}}
    summary = overhead.report([{"rldsl": {"steps": [st] * 3}}], warmup=1, device="cuda")
    out = capsys.readouterr().out
    assert "| CUDA s | host busy s | host busy / CUDA |" in out
    assert "|   update: forward | 0.3000 | 75% | 1.0000 | 0.30x | 0.4000 | 0.1000 | 0.25x |" in out
    assert summary["host_over_cuda"] == pytest.approx((0.1 + 0.3 - 0.2) / (0.2 + 0.4 + 0.2))


def test_slow_steps_split_their_excess_between_the_models_arithmetic_and_the_rest(overhead) -> None:
    def step(total, rollout, forward, record, floor):
        host = {"rollout": rollout, "forward": forward, "backward": 0.01, "record": record}
        return {"step_s": total, "host": host, "floors": {"rollout": floor, "update": floor}}
    steps = [step(0.10, 0.03, 0.02, 0.001, 0.05)] * 8 + [step(0.13, 0.05, 0.03, 0.003, 0.06)]
    slow = overhead.slow_steps(steps)
    assert slow["n"] == 1
    assert slow["model"] == pytest.approx(0.03) and slow["framework"] == pytest.approx(0.002)
    assert slow["floor_ratio"] == pytest.approx(1.2)
    assert overhead.slow_steps(steps[:8]) is None
