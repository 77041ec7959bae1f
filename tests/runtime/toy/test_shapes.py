"""The built-in visual task (data.task = "shapes", runtime/toy/shapes.py) and its embedded tiny
Qwen2-VL (toy/shapes_warmup.py): deterministic pictures, held-out scenes disjoint from every
training scene, the exact reward, rows that pass the image checks and render as a vision
prompt, its evaluation set, and the demo's config (demos/vlm/shapes.toml) doing a step."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from rldsl.runtime.config import SHAPES_TASK, load_config
from rldsl.runtime.data import images
from rldsl.runtime.data.datasets import render_prompt
from rldsl.runtime.data.sources import source_of, with_data
from rldsl.runtime.errors import DataError
from rldsl.runtime.rewards.verify import BUILTIN_REWARDS
from rldsl.runtime.toy import shapes
from rldsl.runtime.toy.shapes_source import SOURCE

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "demos" / "vlm" / "shapes.toml"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLDSL_CACHE", str(tmp_path / "cache"))


def _cfg(**flags):
    return load_config(flags={"data.task": SHAPES_TASK, **flags})


def test_pictures_are_deterministic_by_seed(tmp_path):
    a, b, c = shapes.train_scenes(1, 50), shapes.train_scenes(1, 50), shapes.train_scenes(2, 50)
    assert a == b and a != c
    one = shapes.examples(a, tmp_path / "one")
    two = shapes.examples(b, tmp_path / "two")
    first = lambda ex: Path(ex.source[0]["content"][0]["image"])  # noqa: E731
    assert [first(e).read_bytes() for e in one] == [first(e).read_bytes() for e in two]
    assert [e.answer for e in one] == [s.answer for s in a]
    # a picture shows its answer: the shape's colour at its centre, on its side of the image
    s = a[0]
    img = Image.open(first(one[0])).convert("RGB")
    centre = (s.x + s.size // 2, s.y + s.size - 3)  # inside a square, a circle and a triangle alike
    assert img.getpixel(centre) == shapes.COLOURS[s.colour] and img.size == (56, 56)
    assert (centre[0] < 28) == (s.side == "left")


def test_train_and_heldout_scenes_are_disjoint():
    held = {s.key for s in shapes.heldout_scenes(200)}
    evals = {s.key for s in shapes.scenes(200, shapes.EVAL_SEED, heldout=True)}
    assert len(held) == 200
    for seed in (0, 1, 2, 3):
        train = {s.key for s in shapes.train_scenes(seed)}
        assert len(train) == shapes.TRAIN_ROWS and not train & held and not train & evals
    warm = {s.key for s in shapes.scenes(2200, shapes.WARM_SEED, heldout=False)}
    assert not warm & held and not warm & evals
    # both questions and every answer occur on both sides
    for keys in (shapes.train_scenes(0), shapes.heldout_scenes(200)):
        assert {s.answer for s in keys} == set(shapes.COLOURS) | set(shapes.SIDES)


def test_the_source_rows_reward_and_eval_set():
    cfg = _cfg(**{"data.eval_size": 20})
    src = source_of(cfg)
    assert src is SOURCE and src.reward == "exact"
    rows = src.rows(cfg)
    assert len(rows.train) == shapes.TRAIN_ROWS and len(rows.heldout) == 20
    for i, ex in enumerate(rows.train[:50] + rows.heldout):
        images.check_images(ex.source, f"row {i}", max_images=1)  # exists, reads as an image, one per row
    reward = BUILTIN_REWARDS[src.reward]
    ex = rows.heldout[0]
    wrong = next(a for a in [*shapes.COLOURS, *shapes.SIDES] if a != ex.answer)
    assert reward(ex.reward_prompt, ex.answer, ex.answer) == 1.0
    assert reward(ex.reward_prompt, wrong, ex.answer) == 0.0
    assert src.task_of(ex.reward_prompt) == next(v for k, v in ex.fields if k == "question")
    # `rldsl eval --data shapes:eval` / eval.data: the same source, held-out-side scenes
    evals = source_of(with_data(cfg, shapes.EVAL_PATH))
    assert evals is src
    sets, _ = evals.eval_rows(cfg, shapes.EVAL_PATH, 30, None)
    assert list(sets) == [""] and len(sets[""]) == 30
    train_images = {e.source[0]["content"][0]["image"] for e in rows.train}
    assert not train_images & {e.source[0]["content"][0]["image"] for e in sets[""]}


def test_a_broken_picture_fails_the_image_check(tmp_path):
    ex = shapes.examples(shapes.train_scenes(0, 3))[0]
    path = Path(ex.source[0]["content"][0]["image"])
    path.write_bytes(b"not a png")
    with pytest.raises(DataError, match="cannot be read as an image"):
        images.check_images(ex.source, "row 0", max_images=1)


def test_rows_render_as_vision_prompts_of_the_embedded_tokenizer():
    from rldsl.runtime.models.vision import VisionProcessor
    from rldsl.runtime.toy.shapes_warmup import build_image_processor, build_tokenizer
    tok = build_tokenizer()
    ex = shapes.examples(shapes.train_scenes(0, 2))[0]
    rendered = render_prompt(ex, tok)
    assert images.images_of(rendered.prompt) == (ex.source[0]["content"][0]["image"],)
    assert rendered.prompt.endswith("<|im_start|>assistant\n")
    enc = VisionProcessor(tok, build_image_processor(), 2).encode_refs(rendered.prompt, images.images_of(rendered.prompt))
    assert int(enc["mm_token_type_ids"].sum()) == 4  # 56 x 56: 4 x 4 patches, merged 2 x 2
    assert tok.unk_token_id not in enc["input_ids"][0].tolist()  # every word of the prompt is in the vocabulary
    for answer in [*shapes.COLOURS, *shapes.SIDES]:
        ids = tok(answer, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.decode(ids) == answer


@pytest.mark.slow
def test_warm_start_is_cached_and_the_demo_config_does_a_step(tmp_path, monkeypatch):
    """The demo's config starts and trains a step; the embedded model is a 2-step warm start here
    (the real one trains ~1-2 min once, then comes from the cache)."""
    from typer.testing import CliRunner

    from rldsl.cli import app
    from rldsl.runtime.toy import shapes_warmup

    quick = shapes_warmup.ShapesWarmStart(max_steps=2, train_scenes=64, validation_scenes=8, batch_size=8)
    folder = shapes_warmup.warm_start(quick)
    report = json.loads((folder / "warm_start.json").read_text())
    assert report["steps"] == 2 and (folder / "preprocessor_config.json").is_file()
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert shapes_warmup.warm_start(quick) == folder  # from the cache: not trained again
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    monkeypatch.setattr(shapes_warmup, "embedded_model", lambda: (folder, "quick shapes model"))
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "lite_ppo", "--config", str(DEMO), "--steps", "1", "--out", str(run),
                                      "--set", "rollout.prompts_per_step=4", "--set", "data.eval_size=8",
                                      "--set", "eval.every=1", "--traceback"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 1 and "eval/greedy_acc" in r for r in records)
    assert any("eval/heldout/colour/greedy_acc" in r for r in records)
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert sample["images"] and Path(sample["images"][0]).is_file()


def test_the_warm_start_teacher_confuses_colours_with_their_twins_only():
    import random

    from rldsl.runtime.toy.shapes_warmup import TWINS, teacher_answer, teacher_mode
    rows = shapes.examples(shapes.train_scenes(0, 400))
    rng = random.Random(0)
    said = [(ex, teacher_answer(ex, 0.6, rng)) for ex in rows]
    colour = [(ex, a) for ex, a in said if dict(ex.fields)["question"] == "colour"]
    assert all(a == ex.answer for ex, a in said if dict(ex.fields)["question"] == "side")
    assert all(a in (ex.answer, TWINS[ex.answer]) for ex, a in colour)
    assert 0.5 < sum(a != ex.answer for ex, a in colour) / len(colour) < 0.7
    assert {teacher_mode(ex, 0.6) for ex, _ in colour} <= set(TWINS) and all(
        teacher_mode(ex, 0.6) == TWINS[ex.answer] for ex, _ in colour)
    assert sorted(TWINS) == sorted(shapes.COLOURS) and all(TWINS[TWINS[c]] == c for c in TWINS)
