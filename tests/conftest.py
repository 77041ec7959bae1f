"""Shared fixtures. Every test runs eagerly (``RLDSL_COMPILE=0``, for the processes it starts
too) unless it is marked ``compile``; torch.compile costs seconds per algorithm, so the compiled
algorithms of the tests that ask for them are built once per session and shared. The folders of
pyproject's ``pythonpath`` are importable in every test and in the processes tests start."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable

import pytest

import rldsl

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


#: RLDSL_COMPILE as the suite was started: what a test marked ``compile`` runs with.
STARTED_WITH = os.environ.get("RLDSL_COMPILE")


def pytest_configure(config: pytest.Config) -> None:
    """For the whole session (collection, session and module fixtures, every process a test starts:
    tool workers, ``rldsl`` commands, Ray actors, environment servers): algorithms run eagerly
    (compiled == eager is tested by the tests marked ``compile``; a torch.compile costs seconds),
    and pyproject's ``pythonpath`` folders are importable as they are in the tests."""
    os.environ["RLDSL_COMPILE"] = "0"
    folders = [str(p) for p in config.getini("pythonpath")]
    os.environ["PYTHONPATH"] = os.pathsep.join(folders + [p for p in [os.environ.get("PYTHONPATH")] if p])


@pytest.fixture(autouse=True)
def _compile_when_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``compile`` runs with RLDSL_COMPILE as the suite was started (unset:
    compiled), it and its function-scoped fixtures; where that turns torch.compile off, it is
    skipped with the reason. Every other test stays eager."""
    if request.node.get_closest_marker("compile") is None:
        return
    if STARTED_WITH is None:
        monkeypatch.delenv("RLDSL_COMPILE")
    else:
        monkeypatch.setenv("RLDSL_COMPILE", STARTED_WITH)
    from rldsl.compiled import compile_enabled

    if not compile_enabled():
        pytest.skip(f"RLDSL_COMPILE={STARTED_WITH} turns torch.compile off")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (hidden 32, 2 layers, 2 heads, seed 0) with the toy tokenizer, saved as a
    user model folder: the model of most runs in the suite."""
    import torch
    from transformers import LlamaForCausalLM

    from rldsl.runtime import toy

    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = toy.build_tokenizer()
    config = toy.tiny_config(tokenizer, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


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


@pytest.fixture(scope="session")
def vlm_family_model(tmp_path_factory) -> Callable[[str], Path]:
    """``vlm_family_model("qwen2_5_vl")`` / ``vlm_family_model("qwen3_vl")`` -> an HF folder of a
    tiny random Qwen2.5-VL / Qwen3-VL (tests/fixtures/vlm_families.py), built once per session."""
    import vlm_families as fixture

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = fixture.build_family_model(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get
