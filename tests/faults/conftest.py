"""The fault-injection suite: real `rldsl run` processes of a tiny model, each held, interrupted
or killed at a named phase (runtime/faults.py, never a raced sleep), then resumed; what must
hold after each fault is asserted on the run folder. docs/reliability.md tabulates the faults."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from rldsl.runtime import toy

torch.set_num_threads(1)
HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # every test here trains real runs
        if Path(str(item.fspath)).parent == HERE:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (hidden 32, 2 layers) with the toy tokenizer, as a user model folder."""
    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = toy.build_tokenizer()
    torch.manual_seed(0)
    config = toy.tiny_config(tokenizer, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


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
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("RLDSL_COMPILE", "0")
                done[sets] = loop.train("grpo", load_config(None, [f"model.path={model_dir}", f"out={out}",
                                                                   *BASE, *sets]))
        return done[sets]

    return run


@pytest.fixture(autouse=True)
def _eager_and_helpers(monkeypatch):
    monkeypatch.setenv("RLDSL_COMPILE", "0")
    monkeypatch.syspath_prepend(str(HERE))
