"""Model kinds (models/kinds/): a model's kind chosen once from its config.json, the one list of
kinds, and a vision-language policy's images processed once on the rollout side and carried to
the trainer in the batch (``RolloutBatch.image_inputs``): the trainer's forward reads them with no
processor of its own, and scores the engine's tokens as the engine did."""
from __future__ import annotations

import json

import pytest
import torch

import vlm_model as fixture
from rldsl.runtime.batch import model_inputs
from rldsl.runtime.errors import RunError
from rldsl.runtime.models import kinds
from rldsl.runtime.models.kinds.qwen2_vl import ImageInputs, Qwen2VLKind
from rldsl.runtime.models.kinds.text import TextInputs, TextKind
from rldsl.runtime.models.loading import load_policy, load_tokenizer
from rldsl.runtime.models.vision import VisionPrompt, load_processor
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.logprobs import Forward, token_logprobs
from rldsl.runtime.workers.local import LocalRollouts


def test_the_kind_is_chosen_from_config_json(tmp_path):
    assert isinstance(kinds.kind_of({"model_type": "qwen2"}, tmp_path), TextKind)
    assert isinstance(kinds.kind_of({"model_type": "qwen2_vl"}, tmp_path), TextKind)  # no vision tower
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        assert isinstance(kinds.kind_of({"model_type": family, "vision_config": {}}, tmp_path), Qwen2VLKind)
    # a vision tower no kind reads is refused by name, not trained as text
    with pytest.raises(RunError, match="model_type 'llava'"):
        kinds.kind_of({"model_type": "llava", "vision_config": {}}, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "vision_config": {}}))
    assert kinds.folder_kind(tmp_path).name == "qwen2_vl"
    assert kinds.folder_kind(tmp_path / "missing").name == "text"
    assert kinds.KINDS[-1] is TextKind  # the catch-all, asked last


def test_a_text_kind_reads_no_images():
    kind = TextKind()
    assert kind.processed([[], []]) == [] and kind.message_images([{"role": "user", "content": "x"}]) == []
    with pytest.raises(ValueError, match="text model"):
        kind.image_part("data:image/png;base64,AAAA")
    with pytest.raises(ValueError, match="2 of 3 prompts hold images \\(the first: row 2\\)"):
        kind.check_prompts("data.path=x.jsonl", [1, 2], 3)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    inputs = kind.forward_inputs(None, None, torch.zeros(2, 3, dtype=torch.long), mask)
    assert isinstance(inputs, TextInputs) and not inputs.whole_rows
    assert inputs.padded(None, 2)[0]["position_ids"].tolist() == [[0, 0], [0, 1]]


def test_images_are_processed_once_on_the_rollout_side_and_carried_to_the_trainer(vlm_model, tmp_path):
    torch.manual_seed(0)
    model = load_policy(vlm_model, "float32").eval()
    processor = load_processor(vlm_model)
    paths = fixture.images(tmp_path, 2)
    text = processor.render([{"role": "user", "content": [{"type": "image", "image": "0.png"},
                                                          {"type": "text", "text": "Colour?"}]}])
    plain = processor.render([{"role": "user", "content": "No picture."}])
    engine = HFEngine(model, load_tokenizer(vlm_model))
    assert engine.kind.name == "qwen2_vl"  # chosen once, from the folder's config.json
    rollouts = LocalRollouts(engine, reward=None)
    gen = rollouts.generate([VisionPrompt(text, [str(paths[0])]), plain], ["", ""],
                            SamplingParams(n=2, max_new_tokens=4, min_new_tokens=4, seed=1), score=False)
    batch = gen.batch
    carried = batch.image_inputs
    assert [c is None for c in carried] == [False, False, True, True]
    assert carried[0]["image_grid_thw"].tolist() == [[1, 4, 4]] and carried[0]["pixel_values"].shape[0] == 16
    # a trainer's kind with no folder to read a processor from: it reads what the batch carries
    trainer_kind = Qwen2VLKind(str(tmp_path / "no-such-folder"))
    ids, attn, _ = model_inputs(batch)
    inputs = trainer_kind.forward_inputs(model, batch.select(torch.arange(4)), ids, attn)
    assert isinstance(inputs, ImageInputs) and inputs.whole_rows and trainer_kind._processor is None
    with torch.no_grad():
        lp = token_logprobs(model, Forward(ids, attn, batch.response_ids.shape[1], inputs=inputs)).logprobs
    m = batch.response_mask.bool()
    assert (lp[m] - batch.logprobs[m]).abs().max() < 1e-5
    # a batch without them (an older checkpoint's queued batch) is processed by the kind
    batch.image_inputs = []
    with pytest.raises(RunError, match="preprocessor_config.json"):
        trainer_kind.forward_inputs(model, batch, ids, attn)


def test_the_carried_images_follow_their_rows_through_select_concat_and_a_checkpoint(tmp_path):
    from rldsl.runtime.batch import RolloutBatch, TokenRow
    from rldsl.runtime.run.checkpointing import _batch_of, _plain_batch

    def batch(tag: float) -> RolloutBatch:
        rows = [TokenRow([1, 2], [3], [-0.5], "stop", "p", "c", images=["a.png"]), TokenRow([1], [3, 4], [0.0, 0.0], "stop", "p", "c")]
        b = RolloutBatch.from_rows(rows, 2, 0)
        b.image_inputs = [{"pixel_values": torch.full((4, 3), tag), "image_grid_thw": torch.tensor([[1, 2, 2]])}, None]
        return b

    one, two = batch(1.0), batch(2.0)
    both = RolloutBatch.concat([one, two], 0)
    assert [r is None for r in both.image_inputs] == [False, True, False, True]
    picked = both.select(torch.tensor([2, 3]))
    assert picked.image_inputs[0]["pixel_values"][0, 0] == 2.0 and picked.image_inputs[1] is None
    one.image_inputs = []  # a batch without them: the joined batch has none (its kind processes the refs)
    assert RolloutBatch.concat([one, two], 0).image_inputs == []
    torch.save(_plain_batch(two), tmp_path / "b.pt")
    back = _batch_of(torch.load(tmp_path / "b.pt", weights_only=True))
    assert torch.equal(back.image_inputs[0]["pixel_values"], two.image_inputs[0]["pixel_values"])
    old = _plain_batch(two)
    del old["image_inputs"]  # a queued batch of a checkpoint made before the field
    assert _batch_of(old).image_inputs == []


def test_a_vision_family_no_kind_reads_exits_2_before_the_model_loads(tmp_path):
    from typer.testing import CliRunner

    from rldsl.cli import app
    from rldsl.errors import EXIT_BAD_INPUT

    model = tmp_path / "llava"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}}))  # no weights
    result = CliRunner().invoke(app, ["run", "grpo", "--model", str(model), "--out", str(tmp_path / "run")])
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert "no model kind reads model_type 'llava' with a vision tower" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()
