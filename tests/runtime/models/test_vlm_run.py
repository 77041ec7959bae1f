"""A vision-language run end to end on the tiny random Qwen2-VL (tests/fixtures/vlm_model.py):
`rldsl run` on a data file whose prompts hold images (HF engine, LoRA on the language model,
the vision tower frozen), its checkpoint (with preprocessor_config.json), samples.jsonl's
image paths, `rldsl eval` with images and `rldsl export`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

import vlm_model as fixture
from rldsl.cli import app


def _data(folder: Path, n: int) -> Path:
    fixture.images(folder / "images", n)
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": f"images/{i:04d}.png"},
                                                       {"type": "text", "text": "Colour?"}]},
                          {"role": "assistant", "content": "red"}]} for i in range(n)]
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tensors(folder: Path) -> dict:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.slow
def test_vlm_run_lora_eval_and_export(vlm_model, tmp_path):
    data = _data(tmp_path / "data", 6)
    reward = tmp_path / "varied.py"  # a reward that differs within a group (the random policy never says "red")
    reward.write_text("def varied(prompt, completion, answer):\n    return float(len(completion) % 2)\n")
    run = tmp_path / "run"
    runner = CliRunner()
    result = runner.invoke(app, ["run", "grpo", "--model", str(vlm_model), "--data", str(data), "--steps", "2",
                                 "--out", str(run), "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=2",
                                 "--set", "rollout.max_new_tokens=4", "--set", "data.eval_size=0",
                                 "--set", "model.lora.rank=4", "--set", "train.lr=0.05",
                                 "--reward", f"{reward}:varied", "--seed", "1"])
    assert result.exit_code == 0, result.output
    policy = run / "checkpoints" / "step-2" / "policy"
    assert (policy / "preprocessor_config.json").is_file()  # the processor travels with the weights
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(len(s["images"]) == 1 and s["images"][0].startswith(str(data.parent / "images"))
                           for s in samples)
    assert all("<|vision_start|><|image_pad|><|vision_end|>Colour?" in s["prompt"] for s in samples)

    result = runner.invoke(app, ["eval", str(run), "--data", str(data), "--n", "2", "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output
    assert "greedy_acc" in result.output and "pass@2" in result.output

    out = tmp_path / "export"
    result = runner.invoke(app, ["export", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "preprocessor_config.json").is_file()
    before, after = _tensors(vlm_model), _tensors(out)
    assert before.keys() == after.keys()  # the released names, no LoRA tensor left
    vision = [k for k in before if k.startswith("visual.")]
    language = [k for k in before if k.endswith("self_attn.q_proj.weight")]
    assert vision and all((before[k] == after[k]).all() for k in vision)  # LoRA on the language model only
    assert language and any((before[k] != after[k]).any() for k in language)  # the adapters trained, merged
