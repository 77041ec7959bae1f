"""Vision-language policies (Qwen2-VL family): telling one from a text model, loading it, its
processor, and freezing its vision tower.

The processor is built from the folder's image processor and tokenizer, never through
``AutoProcessor``: transformers' Qwen2-VL processor insists on a video processor, and video
processors need torchvision (not installable on the CPU torch: PyPI's wheels are CUDA builds).
:class:`VisionProcessor` does what ``Qwen2VLProcessor`` does for images -- render the chat
template, run the image processor, expand each ``<|image_pad|>`` into one token per merged
patch, mark those tokens in ``mm_token_type_ids`` -- and saves as a release does
(``preprocessor_config.json`` beside the tokenizer files and chat template).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from rldsl.lazy_torch import torch

from ..errors import RunError
from .loading import load_tokenizer, quiet_transformers

if TYPE_CHECKING:
    from torch import nn

#: The placeholder a Qwen2-VL chat template writes for an image part.
IMAGE_TOKEN = "<|image_pad|>"
#: Module name prefixes of the vision tower in transformers' VLM classes.
VISION_PREFIXES = ("model.visual.", "visual.")


def is_vision_folder(path: str | Path) -> bool:
    """Whether the HF folder at ``path`` holds a vision-language model (its config.json has a
    ``vision_config``). Reads config.json only."""
    config = Path(path) / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def load_vision_policy(path: Path, dtype: str) -> nn.Module:
    """The image-text-to-text model of an HF folder (``Qwen2VLForConditionalGeneration``, ...),
    in ``dtype``, KV cache on."""
    from transformers import AutoModelForImageTextToText

    try:
        with quiet_transformers():
            model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise RunError(f"could not load the vision-language model from {path}: {e}") from None
    model.config.use_cache = True
    return model


def freeze_vision(model: nn.Module) -> int:
    """``requires_grad=False`` on every vision-tower parameter (``model.freeze_vision``);
    returns how many parameters were frozen."""
    frozen = 0
    for name, p in model.named_parameters():
        if name.startswith(VISION_PREFIXES):
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def language_lora_targets(model: nn.Module, names: Sequence[str]) -> str:
    """A peft ``target_modules`` regex matching the linear layers ``names`` (``q_proj``, ...) of
    the language model only, never the vision tower's."""
    alts = "|".join(sorted(set(names)))
    return rf"^(?!.*\bvisual\b).*\.({alts})$"


@dataclass
class VisionProcessor:
    """The tokenizer and image processor of a Qwen2-VL-family folder, used together."""

    tokenizer: Any
    image_processor: Any
    merge_size: int

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The chat template's text, one ``<|image_pad|>`` per image part."""
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def images(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """``pixel_values`` (patches x C*temporal*patch^2) and ``image_grid_thw`` (images x 3)."""
        out = self.image_processor(images=list(images), return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def encode(self, text: str, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """A rendered prompt and its images (in order) as the model's inputs, batch of one:
        ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (1 on image tokens) and, with
        images, ``pixel_values`` and ``image_grid_thw``."""
        pieces = text.split(IMAGE_TOKEN)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {len(pieces) - 1} image placeholders but {len(images)} images")
        vision = self.images(images) if images else {}
        if images:
            counts = (vision["image_grid_thw"].prod(-1) // self.merge_size ** 2).tolist()
            text = pieces[0] + "".join(IMAGE_TOKEN * n + p for n, p in zip(counts, pieces[1:]))
        ids = torch.tensor([self.tokenizer(text, add_special_tokens=False)["input_ids"]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "mm_token_type_ids": (ids == self.image_token_id).long(), **vision}

    def save_pretrained(self, folder: str | Path) -> None:
        """Write the tokenizer (with its chat template) and ``preprocessor_config.json``."""
        self.tokenizer.save_pretrained(str(folder))
        self.image_processor.save_pretrained(str(folder))


def load_processor(path: str | Path, tokenizer: Any = None) -> VisionProcessor:
    """The :class:`VisionProcessor` of a VLM folder: its ``preprocessor_config.json`` read by the
    PIL image processor of its family (no torchvision), and its tokenizer (``tokenizer`` when
    the caller loaded it already)."""
    from transformers import AutoImageProcessor

    path = Path(path)
    if not (path / "preprocessor_config.json").is_file():
        raise RunError(f"{path} is a vision-language model without preprocessor_config.json: save its "
                       "image processor beside the tokenizer (docs/vlm.md)")
    try:
        image_processor = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    except (OSError, ValueError, TypeError, ImportError):
        try:
            image_processor = _pil_image_processor(path)
        except (OSError, ValueError, ImportError) as e:
            raise RunError(f"could not load the image processor of {path}: {e}") from None
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    if IMAGE_TOKEN not in tok.get_vocab():
        raise RunError(f"the tokenizer of {path} has no {IMAGE_TOKEN} token: only Qwen2-VL-family "
                       "vision-language models are supported (docs/vlm.md)")
    merge = int(getattr(image_processor, "merge_size", None) or 2)
    return VisionProcessor(tok, image_processor, merge)


def _pil_image_processor(path: Path) -> Any:
    from transformers import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil.from_pretrained(str(path))
