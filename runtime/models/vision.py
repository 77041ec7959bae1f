"""Vision-language policies (Qwen2-VL family): telling one from a text model, loading it, its
processor, and freezing its vision tower.

The processor is built from the folder's image processor and tokenizer, never through
``AutoProcessor``: transformers' Qwen2-VL processor insists on a video processor, and video
processors need torchvision (not installable on the CPU torch: PyPI's wheels are CUDA builds).
:class:`VisionProcessor` does what ``Qwen2VLProcessor`` does for images -- render the chat
template, run the image processor, expand each ``<|image_pad|>`` into one token per merged
patch, mark those tokens in ``mm_token_type_ids`` -- and saves as a release does
(``preprocessor_config.json`` beside the tokenizer files and chat template). A rendered prompt
that carries its images' refs is a :class:`VisionPrompt` (data files, multi-turn episodes and
agents make them; the engine reads their pixels from the refs). The processor belongs to the
policy's model kind (models/kinds/qwen2_vl.py), which holds it: there is no process-wide one.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from rldsl.lazy_torch import torch

from ..errors import RunError
from .loading import load_tokenizer

if TYPE_CHECKING:
    from torch import nn


#: The placeholder a Qwen2-VL chat template writes for an image part.
IMAGE_TOKEN = "<|image_pad|>"


def language_lora_targets(model: nn.Module, names: Sequence[str]) -> str:
    """A peft ``target_modules`` regex matching the linear layers ``names`` (``q_proj``, ...) of
    the language model only, never the vision tower's."""
    alts = "|".join(sorted(set(names)))
    return rf"^(?!.*\bvisual\b).*\.({alts})$"


class VisionPrompt(str):
    """A rendered prompt (the chat template's text, one ``<|image_pad|>`` per image) that
    carries its images' refs (``images``), in order: the rollout engine encodes them with the
    text, the trainer's forwards read their pixels again, samples.jsonl records them. It is a
    ``str`` everywhere else (rewards, logs); string operations on it return plain strings."""

    images: tuple[str, ...]

    def __new__(cls, text: str, images: Sequence[str]) -> "VisionPrompt":
        out = super().__new__(cls, text)
        out.images = tuple(images)
        return out

    def __reduce__(self):  # pickled to Ray workers with its images
        return (VisionPrompt, (str(self), self.images))


def prompt_alone(prompts: list[str], images: list[list[str]], processed: list[dict[str, torch.Tensor] | None],
                 row: int) -> None:
    """Row ``row`` of a batch (its ``prompts``, ``images``, ``image_inputs``: ``RolloutBatch``'s
    lists, the latter two empty when no row has images) made a row of its prompt alone, in place:
    an agent's padding row made at replay (rollout/replay.py ``padded``) from a copy of an
    episode's row. A row's images are those of all its tokens in order -- its prompt's, then its
    response's (a tool's pictures) -- and its prompt's text spells each of its own with one
    ``<|image_pad|>`` (:meth:`VisionProcessor.prompt`): the prompt's are the first that many,
    their processed inputs the first grids of ``image_grid_thw`` with their patches (a grid
    (t, h, w) is t*h*w rows of ``pixel_values``)."""
    if not images or not images[row]:
        return
    n = str(prompts[row]).count(IMAGE_TOKEN)
    own = list(images[row][:n])
    prompts[row], images[row] = (VisionPrompt(str(prompts[row]), own) if own else str(prompts[row])), own
    if processed and processed[row] is not None:
        grids = processed[row]["image_grid_thw"][:n]
        processed[row] = {"pixel_values": processed[row]["pixel_values"][:int(grids.prod(-1).sum())],
                          "image_grid_thw": grids} if n else None


#: The content-part types that hold an image: ``{"type": "image", "image": REF}`` (transformers')
#: and ``{"type": "image_url", "image_url": {"url": REF}}`` (OpenAI's).
IMAGE_PARTS = ("image", "image_url")


def part_image(part: dict) -> str | None:
    """The ref of an image content part (a path or a data: URL), None when it names none."""
    value = part.get("image") if part.get("type") == "image" else part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) and value else None


@dataclass
class VisionProcessor:
    """The tokenizer and image processor of a Qwen2-VL-family folder, used together."""

    tokenizer: Any
    image_processor: Any
    merge_size: int
    # each image's (pixel_values, image_grid_thw) by its ref: the trainer's old, reference and
    # update forwards of a step read the same images (bounded: cleared when full)
    _pixels: dict[str, tuple[Any, Any]] = field(default_factory=dict, repr=False)

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

    def image_inputs(self, refs: Sequence[str]) -> dict[str, torch.Tensor]:
        """``images`` of the images at ``refs`` (paths or data: URLs; data/images.py), each image
        processed once and kept (the image processor treats every image on its own, so the
        concatenation equals one call on all of them)."""
        for ref in refs:
            if ref not in self._pixels:
                if len(self._pixels) >= 4096:
                    self._pixels.clear()
                out = self.images([load_image(ref)])
                self._pixels[ref] = (out["pixel_values"], out["image_grid_thw"])
        return {"pixel_values": torch.cat([self._pixels[r][0] for r in refs]),
                "image_grid_thw": torch.cat([self._pixels[r][1] for r in refs])}

    def encode(self, text: str, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """A rendered prompt and its images (PIL, in order) as the model's inputs, batch of one:
        ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (1 on image tokens) and, with
        images, ``pixel_values`` and ``image_grid_thw``."""
        return self.expand(text, self.images(images) if images else {}, len(images))

    def encode_refs(self, text: str, refs: Sequence[str]) -> dict[str, torch.Tensor]:
        """:meth:`encode` for images given by their refs (paths or data: URLs; pixels kept)."""
        return self.expand(text, self.image_inputs(refs) if refs else {}, len(refs))

    @staticmethod
    def message_images(messages: Sequence[dict]) -> list[str]:
        """The image refs of chat ``messages`` in order: every image part (IMAGE_PARTS) of a list
        content, whatever turn holds it (a multi-turn episode's, an agent's messages)."""
        out = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, (list, tuple)):
                for p in content:
                    if isinstance(p, dict) and p.get("type") in IMAGE_PARTS:
                        ref = part_image(p)
                        if ref is None:
                            raise ValueError(f"an image part needs a path or a data: URL, got {str(p)[:80]!r}")
                        out.append(ref)
        return out

    @staticmethod
    def prompt(text: str, refs: Sequence[str]) -> "VisionPrompt":
        """``text`` carrying the images ``refs`` (:class:`VisionPrompt`), each image spelled by one
        ``<|image_pad|>`` as a rendered prompt spells it: a text decoded from token ids (an agent's
        row, a multi-turn episode's) has one pad per merged patch, collapsed here, so that
        samples.jsonl shows every image prompt one way."""
        return VisionPrompt(re.sub(f"(?:{re.escape(IMAGE_TOKEN)})+", IMAGE_TOKEN, str(text)), refs)

    def ids(self, text: str, refs: Sequence[str]) -> list[int]:
        """The token ids of ``text`` (a rendered prompt, or a turn's delta) whose ``<|image_pad|>``
        placeholders, one per image of ``refs`` in order, are expanded (a multi-turn episode's or
        an agent's tokens, appended token-in/token-out)."""
        return self.encode_refs(text, refs)["input_ids"][0].tolist()

    def expand(self, text: str, vision: dict[str, torch.Tensor], n_images: int) -> dict[str, torch.Tensor]:
        """The inputs of ``text`` whose ``n_images`` placeholders each become one token per
        merged patch of its image (``vision``: the images' pixel values and grids)."""
        pieces = text.split(IMAGE_TOKEN)
        if len(pieces) - 1 != n_images:
            raise ValueError(f"the prompt has {len(pieces) - 1} image placeholders but {n_images} images")
        if n_images:
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


def open_image(ref: str) -> Any:
    """The image at ``ref`` (a path, or a ``data:image/...;base64,`` URL) opened lazily (PIL)."""
    from PIL import Image
    if ref.startswith("data:"):
        head, _, data = ref.partition(",")
        if ";base64" not in head:
            raise ValueError("a data: URL must be base64-encoded (data:image/png;base64,...)")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"bad base64 data: {e}") from None
        return Image.open(io.BytesIO(raw))
    return Image.open(ref)


def load_image(ref: str) -> Any:
    """The image at ``ref`` (a path or a data: URL) decoded, in RGB."""
    with open_image(ref) as img:
        return img.convert("RGB")


def save_image_processor(model: nn.Module, folder: str | Path) -> None:
    """Copy the image processor's ``preprocessor_config.json`` of a vision-language ``model``
    beside its saved weights and tokenizer (checkpoints, exports); nothing for a text model."""
    config = getattr(model, "config", None)
    src = Path(str(getattr(config, "_name_or_path", "") or "")) / "preprocessor_config.json"
    if getattr(config, "vision_config", None) is not None and src.is_file():
        dst = Path(folder) / "preprocessor_config.json"
        if src.resolve() != dst.resolve():
            shutil.copyfile(src, dst)
