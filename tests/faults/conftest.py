"""The fault-injection suite: real `rldsl run` processes of a tiny model, each held, interrupted
or killed at a named phase (runtime/faults.py, never a raced sleep), then resumed; what must
hold after each fault is asserted on the run folder. docs/reliability.md tabulates the faults."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # every test here trains real runs
        if Path(str(item.fspath)).parent == HERE:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def reference(model_dir, tmp_path_factory):
    """``reference(*sets)``: the uninterrupted run of the suite's runs (``BASE`` + ``sets``), trained
    in this process once per set of overrides and shared by the tests that compare with it (read
    only)."""
    from rldsl.runtime.config import load_config
    from rldsl.runtime.run import loop

    from fault_helpers import BASE
    done: dict[tuple[str, ...], Path] = {}

    def run(*sets: str) -> Path:
        if sets not in done:
            out = tmp_path_factory.mktemp("reference") / "run"
            done[sets] = loop.train("grpo", load_config(None, [f"model.path={model_dir}", f"out={out}",
                                                               *BASE, *sets]))
        return done[sets]

    return run

