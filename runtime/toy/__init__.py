"""The embedded default of ``rldsl run``: a character tokenizer, a 0.59M-parameter Llama
(model.py), 2-digit addition (task.py) and a cached warm start (warmup.py); docs/toy.md.

The names below load their module on first use: the built-in tasks' rows of the sources table
(toy/sources.py) are read before torch and transformers load (``rldsl run`` checks first)."""
from __future__ import annotations

import importlib
from typing import Any

#: name -> the module of this package that defines it
_HOMES = {
    **dict.fromkeys(["CHARACTERS", "SPECIAL_TOKENS", "VLLM_VARIANT", "build_tokenizer", "tiny_config",
                     "vllm_variant_config"], "model"),
    **dict.fromkeys(["AdditionTask", "carry_free_sum", "teacher_answer"], "task"),
    **dict.fromkeys(["WARM_START_VERSION", "WarmStartConfig", "evaluate_greedy", "greedy_answers",
                     "load_warm_start", "warm_start", "warm_start_key"], "warmup"),
}

__all__ = sorted([*_HOMES, "cache_dir"])


def __getattr__(name: str) -> Any:
    if name == "cache_dir":
        return importlib.import_module("rldsl.cache").cache_dir
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
