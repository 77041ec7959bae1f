"""Shared fixtures. torch.compile costs seconds per algorithm, so compiled algorithms are
built once per test session and shared by every test that asks for them."""
from __future__ import annotations

from typing import Callable

import pytest

import rldsl


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
