"""The built-in visual task (``data.task = "shapes"``): a picture of one coloured shape and a
question a tiny vision-language model can only answer by reading the pixels -- "what colour is
the shape ?" (six colours) or "is the shape on the left or the right ?" -- scored by the
``exact`` match of its one-word answer (docs/vlm.md "A CPU demo").

Every picture is drawn here, offline, with PIL (56 x 56 pixels: 4 x 4 patches of 14, four image
tokens after the 2 x 2 merge) and written once as a PNG under the rldsl cache folder
(``shapes/<key>/``), so the rows are an ordinary chat with an image part and go through the same
image checks, rendering, engines and trainer forwards as a data file's. A scene is (question,
shape, colour, x, y, size); the scenes are split by a hash of that key, so a held-out scene is
never a training scene whatever the seeds: training rows are drawn from the run's seed, the
held-out rows from a fixed seed, the evaluation sets (``eval.data`` / ``rldsl eval --data
shapes:eval``) from a third, the warm start's (toy/shapes_warmup.py) from a fourth, all of them
only ever from their side of the split. Its row of the sources table: toy/shapes_source.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from rldsl.cache import cache_dir

from ..config import SHAPES_TASK
from ..data.datasets import Example

#: Bumped whenever a picture or a question changes: part of the images' cache key.
SHAPES_VERSION = 1
COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 240),
           "yellow": (240, 220, 40), "purple": (150, 50, 200), "orange": (250, 140, 20)}
SHAPES = ("square", "circle", "triangle")
SIDES = ("left", "right")
#: question kind -> its text (the user turn after the picture)
QUESTIONS = {"colour": "what colour is the shape ?", "side": "is the shape on the left or the right ?"}
IMAGE_SIZE = 56
BACKGROUND = (128, 128, 128)
#: the seeds of the sets that are not the run's training rows (added to nothing: fixed)
HELDOUT_SEED, EVAL_SEED, WARM_SEED = 1_000_003, 2_000_003, 3_000_003
#: one scene in this many is a held-out scene (by its key's hash)
HELDOUT_ONE_IN = 5
#: the eval set path this kind claims (``eval.data``, ``rldsl eval --data``)
EVAL_PATH = f"{SHAPES_TASK}:eval"
TRAIN_ROWS = 2000


@dataclass(frozen=True)
class Scene:
    """One picture and its question; ``answer`` is what the picture shows."""

    question: str  # a key of QUESTIONS
    shape: str
    colour: str
    x: int  # the shape's box: left, top, side length
    y: int
    size: int

    @property
    def side(self) -> str:
        return SIDES[0] if self.x + self.size / 2 < IMAGE_SIZE / 2 else SIDES[1]

    @property
    def answer(self) -> str:
        return self.colour if self.question == "colour" else self.side

    @property
    def key(self) -> str:
        return f"{self.question}|{self.shape}|{self.colour}|{self.x}|{self.y}|{self.size}"

    @property
    def heldout(self) -> bool:
        """Which side of the split the scene is on (a hash of its key: seed-independent)."""
        return int(hashlib.sha256(self.key.encode()).hexdigest(), 16) % HELDOUT_ONE_IN == 0

    def draw(self) -> Any:
        """The picture (PIL, RGB)."""
        from PIL import Image, ImageDraw
        img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
        d = ImageDraw.Draw(img)
        box = [self.x, self.y, self.x + self.size - 1, self.y + self.size - 1]
        fill = COLOURS[self.colour]
        if self.shape == "square":
            d.rectangle(box, fill=fill)
        elif self.shape == "circle":
            d.ellipse(box, fill=fill)
        else:
            d.polygon([(self.x + self.size / 2, self.y), (self.x, self.y + self.size - 1),
                       (self.x + self.size - 1, self.y + self.size - 1)], fill=fill)
        return img


def random_scene(rng: random.Random) -> Scene:
    """A scene drawn by ``rng``: the shape wholly inside the left or the right half."""
    size = rng.randint(10, 20)
    half = IMAGE_SIZE // 2
    left = rng.random() < 0.5
    x = rng.randint(2, half - size - 2) if left else rng.randint(half + 2, IMAGE_SIZE - size - 2)
    return Scene(rng.choice(list(QUESTIONS)), rng.choice(SHAPES), rng.choice(list(COLOURS)), x,
                 rng.randint(2, IMAGE_SIZE - size - 2), size)


def scenes(count: int, seed: int, heldout: bool, exclude: frozenset[str] = frozenset()) -> list[Scene]:
    """``count`` distinct scenes of one side of the split (``heldout``), drawn from ``seed``."""
    rng = random.Random(seed)
    out: dict[str, Scene] = {}
    for _ in range(200 * count + 1000):
        if len(out) == count:
            return list(out.values())
        s = random_scene(rng)
        if s.heldout == heldout and s.key not in out and s.key not in exclude:
            out[s.key] = s
    raise ValueError(f"could not draw {count} distinct {'held-out' if heldout else 'training'} scenes")


def _key(scene_list: Sequence[Scene]) -> str:
    blob = json.dumps({"version": SHAPES_VERSION, "colours": COLOURS, "size": IMAGE_SIZE,
                       "background": BACKGROUND, "scenes": [asdict(s) for s in scene_list]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_images(scene_list: Sequence[Scene], cache: str | os.PathLike | None = None) -> list[Path]:
    """The PNGs of ``scene_list`` (``<cache>/shapes/<key>/NNNNN.png``), drawn on a cache miss."""
    root = (Path(cache) if cache is not None else cache_dir()) / SHAPES_TASK
    target = root / _key(scene_list)
    paths = [target / f"{i:05d}.png" for i in range(len(scene_list))]
    if (target / "scenes.json").is_file():
        return paths
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        for i, s in enumerate(scene_list):
            s.draw().save(tmp / f"{i:05d}.png")
        (tmp / "scenes.json").write_text(json.dumps([asdict(s) for s in scene_list]))
        try:
            os.replace(tmp, target)
        except OSError:  # another process wrote it first: keep its copy
            if not (target / "scenes.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths


def examples(scene_list: Sequence[Scene], cache: str | os.PathLike | None = None) -> list[Example]:
    """The rows of ``scene_list``: one user turn holding the picture, then the question; the
    answer one word (the ``exact`` reward's reference)."""
    out = []
    for i, (s, path) in enumerate(zip(scene_list, write_images(scene_list, cache))):
        content = ({"type": "image", "image": str(path)}, {"type": "text", "text": QUESTIONS[s.question]})
        out.append(Example(id=i, prompt="", answer=s.answer, source=({"role": "user", "content": content},),
                           fields=(("question", s.question),)))
    return out


def train_scenes(seed: int, count: int = TRAIN_ROWS) -> list[Scene]:
    return scenes(count, seed, heldout=False)


def heldout_scenes(count: int) -> list[Scene]:
    return scenes(count, HELDOUT_SEED, heldout=True)


def question_of(prompt: str) -> str | None:
    """The question kind of a held-out row's reward prompt (its text), by which the held-out
    metrics are also split; None for another prompt."""
    return next((k for k, q in QUESTIONS.items() if prompt.strip() == q), None)
