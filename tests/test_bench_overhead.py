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

