"""Prompts with images (runtime/data/images.py): image parts in a messages chat or data.image_key,
paths relative to the data file, data: URLs, and the errors (missing, unreadable, too many images)
that exit 2 naming the row before any model loads."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import vlm_model as fixture
from rldsl.cli import app
from rldsl.errors import EXIT_BAD_INPUT
from rldsl.runtime.data.datasets import load_examples, render_prompt
from rldsl.runtime.data.images import prompt_images
from rldsl.runtime.models.vision import load_image
from rldsl.runtime.errors import DataError


def _chat(*refs: str, question: str = "What colour?", answer: str = "red") -> dict:
    return {"messages": [{"role": "user", "content": [*({"type": "image", "image": r} for r in refs),
                                                      {"type": "text", "text": question}]},
                         {"role": "assistant", "content": answer}]}


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    fixture.images(tmp_path / "data" / "images", 3)
    return tmp_path / "data"


def test_image_parts_resolve_against_the_data_file(data, tmp_path, monkeypatch) -> None:
    png = (data / "images" / "0001.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    path = _write(data / "train.jsonl", [_chat("images/0000.png"), _chat(url, "images/0002.png", answer="blue"),
                                         {"messages": [{"role": "user", "content": "no picture"},
                                                       {"role": "assistant", "content": "ok"}]}])
    monkeypatch.chdir(tmp_path)  # not the data file's folder
    ex = load_examples(path)
    assert [e.answer for e in ex] == ["red", "blue", "ok"]
    assert prompt_images(ex[0].row_prompt) == (str(data / "images" / "0000.png"),)
    assert prompt_images(ex[1].row_prompt) == (url, str(data / "images" / "0002.png"))
    assert prompt_images(ex[2].row_prompt) == ()
    assert ex[0].reward_prompt == "What colour?"  # rewards see the text, as before
    assert load_image(url).tobytes() == fixture.image(1).tobytes()
    tok = fixture.build_vlm_tokenizer()  # Qwen2-VL's released template renders the parts
    rendered = render_prompt(ex[0], tok).prompt
    assert "<|vision_start|><|image_pad|><|vision_end|>What colour?" in rendered
    assert rendered.images == (str(data / "images" / "0000.png"),)  # the prompt carries its images
    import pickle
    assert pickle.loads(pickle.dumps(rendered)).images == rendered.images  # to Ray workers too


def test_image_key_beside_a_text_prompt(data) -> None:
    path = _write(data / "train.jsonl", [{"prompt": "Which?", "answer": "a", "image": "images/0000.png"},
                                         {"prompt": "Both?", "answer": "b", "image": ["images/0001.png",
                                                                                       "images/0002.png"]}])
    ex = load_examples(path, image_field="image")
    assert prompt_images(ex[1].row_prompt) == tuple(str(data / "images" / f"000{i}.png") for i in (1, 2))
    assert ex[0].row_prompt[0]["content"][-1] == {"type": "text", "text": "Which?"}
    with pytest.raises(DataError, match=r"line 1: missing field 'picture' \(data.image_key"):
        load_examples(path, image_field="picture")


@pytest.mark.parametrize("column", ["image", "images"])
def test_an_image_column_no_setting_reads_is_refused(data, tmp_path, column) -> None:
    """TRL's and verl's image columns (``image``, ``images``) with data.image_key unset: the row
    would train on its text alone, silently (issue 57); refused naming the row and the setting,
    exit 2 before the model loads (the folder has a config and no weights). A column with nothing
    in it, or a chat whose turns hold the images, is read as it is."""
    row = {"prompt": "Which?", "answer": "a", column: ["images/0000.png"]}
    path = _write(data / "train.jsonl", [{"prompt": "Which?", "answer": "a", column: None}, row])
    with pytest.raises(DataError, match=rf"train.jsonl: line 2: the row has an image column '{column}' and "
                                        rf"data.image_key is not set.*--set data.image_key={column}"):
        load_examples(path)
    assert prompt_images(load_examples(_write(data / "keyed.jsonl", [row]), image_field=column)[0].row_prompt)
    chat = {**_chat("images/0000.png"), column: "images/0000.png"}
    assert prompt_images(load_examples(_write(data / "chat.jsonl", [chat]))[0].row_prompt)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {}}))
    (model / "preprocessor_config.json").write_text("{}")
    result = CliRunner().invoke(app, ["run", "grpo", "--model", str(model), "--data", str(path),
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert f"data.image_key={column}" in result.output and not (tmp_path / "run").exists()


def test_a_vision_language_folder_without_its_image_processor_exits_2_before_the_model_loads(data, tmp_path) -> None:
    """preprocessor_config.json is read when the model is built: its absence was an error after the
    model loaded, leaving a run folder that blocked reusing --out (issue 57); now exit 2 first."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {}}))
    path = _write(data / "train.jsonl", [_chat("images/0000.png")])
    result = CliRunner().invoke(app, ["run", "grpo", "--model", str(model), "--data", str(path),
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert "is a vision-language model without preprocessor_config.json" in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("rows, match", [
    ([_chat("images/0000.png"), _chat("images/0404.png")], r"line 2: image file .*0404.png does not exist"),
    ([_chat("images/notes.txt")], r"line 1: image .*notes.txt cannot be read as an image"),
    ([_chat("data:image/png;base64,bm90IGEgcG5n")], r"line 1: image data:image/png;base64,.* cannot be read"),
    ([_chat("images/0000.png"), _chat("images/0000.png", "images/0001.png", "images/0002.png")],
     r"line 2: 3 images, more than data.max_images=2"),
    ([{"messages": [{"role": "user", "content": [{"type": "image"}]}]}], r"line 1: field .messages.: an image part needs a path"),
])
def test_bad_images_name_the_row(data, rows, match) -> None:
    (data / "images" / "notes.txt").write_text("not an image")
    with pytest.raises(DataError, match=match):
        load_examples(_write(data / "train.jsonl", rows), max_images=2)


def test_run_exits_2_naming_the_row_before_the_model_loads(data, tmp_path) -> None:
    """The model folder has a config and no weights: the data error comes first."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    path = _write(data / "train.jsonl", [_chat("images/0000.png"), _chat("images/0009.png")])
    result = CliRunner().invoke(app, ["run", "grpo", "--model", str(model), "--data", str(path),
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert "train.jsonl: line 2: image file" in result.output and "0009.png does not exist" in result.output
    result = CliRunner().invoke(app, ["run", "grpo", "--model", str(model), "--data", str(path),
                                      "--set", "data.max_images=0", "--out", str(tmp_path / "run")])
    assert result.exit_code == EXIT_BAD_INPUT and "max_images" in result.output


@pytest.mark.parametrize("spec, flags, match", [
    ("ppo", [], "ppo's critic \\(a value model\\)"),
    ("grpo", ["--set", "rollout.partial=true", "--set", "rollout.max_staleness=1"], "rollout.partial=true"),
])
def test_unsupported_vlm_settings_exit_2_before_the_model_loads(vlm_model, data, tmp_path, spec, flags, match) -> None:
    import re
    path = _write(data / "train.jsonl", [_chat("images/0000.png")])
    result = CliRunner().invoke(app, ["run", spec, "--model", str(vlm_model), "--data", str(path),
                                      "--out", str(tmp_path / "run"), *flags])
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert "is a vision-language model" in result.output and re.search(match, result.output), result.output
