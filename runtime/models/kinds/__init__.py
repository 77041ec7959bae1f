"""Model kinds: what a model family adds to its forwards and prompts (positions, image tokens, the
inputs beside the ids; base.py: the interface; text.py, qwen2_vl.py: the kinds), the one explicit
list of kinds, and the one choice of a model's kind from its config.json (docs/architecture.md,
"Model kinds").

A model's kind is chosen once, from what its folder's config.json says (``model_type``; a vision
tower: ``vision_config``), by whoever holds the model (the trainer at construction, an engine)
and kept: no forward looks a processor up by the model's name. Adding a family is adding its
module beside qwen2_vl.py and its class to :data:`KINDS`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import RunError
from .base import ModelKind
from .qwen2_vl import Qwen2VLKind
from .text import TextKind

#: every kind, asked in order; the first that claims a config is the model's
KINDS: tuple[type, ...] = (Qwen2VLKind, TextKind)


def kind_of(config: dict, folder: str | Path, tokenizer: Any = None) -> ModelKind:
    """The kind of the model whose config.json is ``config`` (a dict), in ``folder``; a model with
    a vision tower that no kind reads is refused."""
    for kind in KINDS:
        if kind.claims(config):
            return kind(str(folder), tokenizer)
    raise RunError(f"{folder}: no model kind reads model_type {config.get('model_type')!r} with a vision tower; "
                   "the vision-language families supported are the Qwen2-VL family's (docs/vlm.md)")


def folder_kind(folder: str | Path, tokenizer: Any = None) -> ModelKind:
    """The kind of the model in the HF folder ``folder`` (its config.json read; none: text)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return kind_of(config, folder, tokenizer)


def model_kind(model: Any, tokenizer: Any = None) -> ModelKind:
    """The kind of a loaded ``model``: its config (config.json as loaded, ``model.config``) and
    the folder it was loaded from; a module without an HF config (a test's stand-in) is text."""
    config = getattr(model, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {}
    return kind_of(settings, getattr(config, "_name_or_path", ""), tokenizer)


def text_kind(tokenizer: Any = None) -> ModelKind:
    """A text model's kind: what a caller that holds no model's kind reads prompts with."""
    return TextKind("", tokenizer)
