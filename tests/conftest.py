"""Shared fixtures. torch.compile costs seconds per algorithm, so compiled algorithms are
built once per test session and shared by every test that asks for them."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

import pytest

import rldsl

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))  # real_model, real_tools (also for the tool processes)

#: Set by `make test-vllm` (and so by `make test` and CI): a missing vLLM fails the
#: real-vLLM tests instead of skipping them.
REQUIRE_VLLM = "RLDSL_REQUIRE_VLLM"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``vllm`` run against a real vLLM: without one they are skipped with the
    reason, or fail when RLDSL_REQUIRE_VLLM=1 (CI must never skip them silently)."""
    if item.get_closest_marker("vllm") is None or importlib.util.find_spec("vllm") is not None:
        return
    reason = ("vLLM is not installed in this environment: the real-vLLM tests run in the "
              ".venv-vllm venv (make setup-vllm, then make test-vllm)")
    if os.environ.get(REQUIRE_VLLM) == "1":
        pytest.fail(f"{REQUIRE_VLLM}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def compiled_algorithm() -> Callable[[str], rldsl.CompiledAlgorithm]:
    """``compiled_algorithm("grpo")`` -> the session's torch.compile'd CompiledAlgorithm."""
    cache: dict[str, rldsl.CompiledAlgorithm] = {}

    def get(name: str) -> rldsl.CompiledAlgorithm:
        if name not in cache:
            cache[name] = rldsl.compile(rldsl.load(name), compile=True)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def eager_algorithm() -> Callable[[str], rldsl.CompiledAlgorithm]:
    """``eager_algorithm("grpo")`` -> the session's eager (compile=False) CompiledAlgorithm."""
    cache: dict[str, rldsl.CompiledAlgorithm] = {}

    def get(name: str) -> rldsl.CompiledAlgorithm:
        if name not in cache:
            cache[name] = rldsl.compile(rldsl.load(name), compile=False)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def real_model(tmp_path_factory) -> Callable[..., Path]:
    """``real_model("qwen2.5")`` -> an HF folder of the real-shaped fixture (tests/fixtures/README.md:
    byte-level BPE, the family's released chat template with tools, random init), built once per
    session; ``real_model("llama3.1")`` the other family; ``warm=True`` -> its tool warm start
    (calls get_weather; cached on disk under the rldsl cache folder, by a hash of its settings)."""
    import real_model as fixture
    from rldsl.cache import cache_dir

    built: dict[tuple[str, bool], Path] = {}

    def get(family: str = "qwen2.5", warm: bool = False) -> Path:
        if (family, False) not in built:
            built[family, False] = fixture.build_real_model(family, tmp_path_factory.mktemp(f"real-{family}"))
        if warm and (family, True) not in built:
            built[family, True] = fixture.tool_warm_start(built[family, False], cache_dir() / "test_fixtures")
        return built[family, warm]

    return get


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """A small tool model that has learned the call format (always calls: TeacherMix.call=1), as
    an HF folder; shared by the agent, environment, tool-demo and fault tests (trained once a session)."""
    from rldsl.runtime.toy.calculator import SumTask, TeacherMix
    from rldsl.runtime.toy.tool_model import tool_model_config
    from rldsl.runtime.toy.tool_warmup import ToolWarmStartConfig, tool_warm_start
    import torch

    config = ToolWarmStartConfig(steps=300, batch_size=16, lr=3e-3, mix=TeacherMix(call=1.0),
                                 task=SumTask(num_train=2000, num_validation=10))
    small = tool_model_config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    torch.set_num_threads(1)
    return tool_warm_start(config, model_config=small, cache=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def moe_model(tmp_path_factory) -> Callable[[str], Path]:
    """``moe_model("qwen3_moe")`` / ``moe_model("mixtral")`` -> an HF folder of a tiny random
    mixture-of-experts model (tests/fixtures/moe_model.py), built once per session."""
    import moe_model as fixture

    built: dict[str, Path] = {}

    def get(arch: str = "qwen3_moe") -> Path:
        if arch not in built:
            built[arch] = fixture.build_moe_model(arch, tmp_path_factory.mktemp(f"moe-{arch}"))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def vlm_model(tmp_path_factory) -> Path:
    """An HF folder of the tiny random Qwen2-VL (tests/fixtures/vlm_model.py: Qwen2-VL's released
    chat template, a ``Qwen2VLImageProcessorPil`` image processor, no torchvision), built once per
    session."""
    import vlm_model as fixture
    return fixture.build_vlm_model(tmp_path_factory.mktemp("vlm"))
