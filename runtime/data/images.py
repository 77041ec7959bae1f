"""Prompts with images (docs/vlm.md): image parts in a ``messages`` chat, or ``data.image_key``
beside a text prompt; where each image is, checked before any model loads, and read lazily.

An image part is ``{"type": "image", "image": REF}`` (also ``{"type": "image_url", "image_url":
{"url": REF}}``, the OpenAI shape) in a user turn's content list; REF is a path relative to the
data file (or absolute), or a ``data:image/...;base64,...`` URL. ``data.image_key`` names a
column holding one REF or a list of them: the row's text prompt becomes one user turn with those
images first, then the text. Paths are resolved against the data file's folder when the file is
read; :func:`check_images` opens every image's header (no pixels decoded) and counts them
against ``data.max_images``, raising a ``DataError`` that names the file and the row; the
pixels are decoded only when a prompt is encoded (models/vision.py ``load_image``).
A rendered prompt with images is a ``VisionPrompt`` (models/vision.py): its text, carrying its
image refs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import DataError
from ..models.vision import open_image, part_image

#: The content-part types a prompt's messages may hold.
PART_TYPES = ("text", "image", "image_url")
#: The columns other trainers read a row's images from (TRL's ``image`` / ``images``, verl's
#: ``images``): a row holding one is never read as text alone without a word (:func:`check_unused_columns`)
IMAGE_COLUMNS = ("image", "images")


def _ref(part: dict, where: str) -> str:
    value = part_image(part)
    if value is None:
        raise DataError(f"{where}: an image part needs a path or a data: URL, got {str(part)[:80]!r}")
    return value


def resolve(ref: str, base: Path) -> str:
    """A data: URL as it is; a path made absolute against ``base`` (the data file's folder)."""
    if ref.startswith("data:"):
        return ref
    path = Path(ref).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def parts(content: Any, where: str, base: Path) -> tuple[dict, ...] | None:
    """A message's content list as normalised parts (``{"type": "text", "text": ...}`` and
    ``{"type": "image", "image": RESOLVED}``), or None when ``content`` is not a list of parts."""
    if hasattr(content, "tolist"):
        content = content.tolist()
    if not isinstance(content, (list, tuple)) or not content:
        return None
    out = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
            return None
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                return None
            out.append({"type": "text", "text": part["text"]})
        else:
            out.append({"type": "image", "image": resolve(_ref(part, where), base)})
    return tuple(out)


def with_image_column(prompt: Any, refs: Any, where: str, base: Path, key: str) -> tuple[dict, ...]:
    """A text prompt and its ``data.image_key`` column as one user turn: the images, then the text."""
    if hasattr(refs, "tolist"):
        refs = refs.tolist()
    refs = [refs] if isinstance(refs, str) else refs
    if not isinstance(refs, (list, tuple)) or not all(isinstance(r, str) and r for r in refs):
        raise DataError(f"{where}: field {key!r} (data.image_key) must be an image path, a data: URL "
                        f"or a list of them, got {str(refs)[:80]!r}")
    if not isinstance(prompt, str):
        raise DataError(f"{where}: data.image_key needs a text prompt; a messages prompt holds its images "
                        "as image parts in its user turns (docs/vlm.md)")
    content = [{"type": "image", "image": resolve(r, base)} for r in refs] + [{"type": "text", "text": prompt}]
    return ({"role": "user", "content": tuple(content)},)


def check_unused_columns(row: dict, where: str, used: Sequence[str]) -> None:
    """A row with an image column (IMAGE_COLUMNS) that no setting reads (``data.image_key`` unset,
    ``used``: the columns the run reads) is refused with a DataError naming the row: its prompt
    would train on the text alone, silently -- the column is not taken on a guess either, since
    what the model sees must be what the user chose (docs/vlm.md)."""
    for key in IMAGE_COLUMNS:
        value = row.get(key)
        if hasattr(value, "tolist"):
            value = value.tolist()
        if key in used or value is None or value == "" or (isinstance(value, (list, tuple)) and not value):
            continue
        raise DataError(f"{where}: the row has an image column {key!r} and data.image_key is not set: its "
                        f"images would be left out and the prompt trained on its text alone. Set "
                        f"data.image_key={key} (--set data.image_key={key}) to put them in the prompt, for a "
                        "vision-language model (--model; docs/vlm.md), or drop the column to train on the text")


def content_text(content: Any) -> str:
    """A message's text: a string as it is, a list of parts as its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p.get("type") == "text")


def prompt_images(source: Any) -> tuple[str, ...]:
    """The image refs of a prompt's messages, in order (none for a text prompt)."""
    if isinstance(source, str):
        return ()
    return tuple(p["image"] for m in source if not isinstance(m["content"], str)
                 for p in m["content"] if p.get("type") == "image")


def image_rows(rows: Sequence[Any]) -> list[int]:
    """The ids (0-based) of the rows (``datasets.Example``) whose prompts hold images."""
    return [e.id for e in rows if prompt_images(e.row_prompt)]


def _shown(ref: str) -> str:
    return ref if not ref.startswith("data:") else ref[:40] + "..."


def check_images(source: Any, where: str, max_images: int) -> None:
    """Every image of a prompt exists and reads as an image (header verified, no pixels
    decoded), and there are at most ``max_images``; else a DataError naming ``where``."""
    refs = prompt_images(source)
    if len(refs) > max_images:
        raise DataError(f"{where}: {len(refs)} images, more than data.max_images={max_images} "
                        "(raise it, or drop images from the row)")
    for ref in refs:
        if not ref.startswith("data:") and not Path(ref).is_file():
            raise DataError(f"{where}: image file {ref} does not exist (paths are relative to the data file)")
        try:
            with open_image(ref) as img:
                img.verify()
        except Exception as e:  # PIL raises several types for a bad file
            raise DataError(f"{where}: image {_shown(ref)} cannot be read as an image: {e}") from None


def images_of(prompt: Any) -> tuple[str, ...]:
    """The image refs a prompt carries (a ``VisionPrompt``'s: models/vision.py), else none."""
    return getattr(prompt, "images", ())


def checked_image_url(part: dict) -> str:
    """The URL of an OpenAI ``image_url`` content part, checked: a ``data:image/...;base64`` URL of
    a readable image (the agents' endpoint reaches no network); ValueError saying what is wrong."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError("an image_url part needs {'url': 'data:image/...;base64,...'}")
    if url.startswith(("http://", "https://")):
        raise ValueError("image_url: http(s) URLs are not fetched (the endpoint reaches no network): "
                         "send the image inline as a data: URL (data:image/png;base64,...)")
    if not url.startswith("data:image/"):
        raise ValueError(f"image_url must be a data:image/...;base64 URL, got {url[:40]!r}")
    try:
        with open_image(url) as img:
            img.verify()
    except Exception as e:  # noqa: BLE001 - PIL raises several types for bad bytes
        raise ValueError(f"image_url: the data: URL is not a readable image: {e}") from None
    return url


def chat_content(content: Any, image_part: Callable[[str], dict], text: Callable[[Any], str]) -> Any:
    """A request message's content as the chat template takes it: ``text(content)``, or -- when it
    holds ``image_url`` parts -- its text parts and each image as ``image_part(url)`` (the model
    kind's part, which refuses images for a text model), in order; ValueError as
    :func:`checked_image_url` raises."""
    if not (isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content)):
        return text(content)
    kept = [p for p in content if isinstance(p, dict) and p.get("type") in ("image_url", "text")]
    return [image_part(checked_image_url(p)) if p["type"] == "image_url" else {"type": "text", "text": p.get("text", "")}
            for p in kept]
