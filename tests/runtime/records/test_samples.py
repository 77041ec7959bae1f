"""samples.jsonl: a few groups per step with the prompt as fed to the model, and
``rldsl samples RUN [--step N]``."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rldsl.cli import app
from rldsl.runtime.run import loop
from rldsl.runtime.config import load_config
from rldsl.runtime.records.run_dir import SAMPLES_FILE
from rldsl.runtime.records.samples import read_samples, truncate_samples


@pytest.mark.slow
def test_run_writes_samples_and_the_command_shows_them(model_dir, tmp_path) -> None:
    cfg = load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'run'}",
                             "rollout.prompts_per_step=4", "rollout.n=4", "train.steps=2",
                             "eval.every=0", "eval.samples=0", "data.eval_size=4", "checkpoint.every=0",
                             "log.progress=false", "reward.name=reward_helpers:parity",
                             "log.samples_per_step=2"])
    run = loop.train("grpo", cfg)
    lines = [json.loads(l) for l in (run / SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in lines] == [1] * 8 + [2] * 8  # 2 groups x G = 4, two steps
    assert [r["group"] for r in lines[:8]] == [0] * 4 + [1] * 4
    for r in lines:
        assert r["prompt"].endswith("=") and r["finish_reason"] in ("stop", "length")
        assert r["reward"] in (0.0, 1.0) and r["response_length"] >= 1
    for g in range(2):  # grpo: group-mean baseline, so a group's advantages sum to ~0
        assert abs(sum(r["advantage"] for r in lines[4 * g: 4 * g + 4])) < 1e-4
    step, rows = read_samples(run)
    assert step == 2 and rows == lines[8:]
    res = CliRunner().invoke(app, ["samples", str(run), "--step", "1"])
    assert res.exit_code == 0, res.output
    assert "step 1" in res.output and lines[0]["prompt"] in res.output
    res = CliRunner().invoke(app, ["samples", str(run), "--step", "9"])
    assert res.exit_code == 2 and "no samples of step 9 (steps 1..2)" in res.output


def test_resume_drops_later_samples(tmp_path) -> None:
    recs = [dict(step=s, group=0, prompt=f"p{s}", completion="", reward=1.0, advantage=0.0,
                 finish_reason="stop", response_length=1) for s in (1, 2, 3)]
    (tmp_path / SAMPLES_FILE).write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 4, "gr')
    truncate_samples(tmp_path, 2)  # resumed from the checkpoint of step 2
    assert read_samples(tmp_path) == (2, [recs[1]])
    assert read_samples(tmp_path, 1) == (1, [recs[0]])
    with pytest.raises(FileNotFoundError):
        read_samples(tmp_path / "missing")


@pytest.mark.slow
def test_each_reward_term_is_logged_and_kept_per_sample(model_dir, tmp_path) -> None:
    """rewards/<term>/mean and /std (TRL's names) per step, each term's value per sample in
    samples.jsonl as the verifier returned it (0.2 is 0.2, not float32's 0.20000000298); the
    weighted sum is the sample's reward, exactly."""
    cfg = load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'run'}",
                             "rollout.prompts_per_step=2", "rollout.n=4", "train.steps=2",
                             "eval.every=0", "eval.samples=0", "data.eval_size=4", "checkpoint.every=0",
                             "log.progress=false", "log.samples_per_step=2"],
                      flags={"reward.name": "reward_helpers:parity=0.25,reward_helpers:answer_prefix=0.75,"
                                            "reward_helpers:fifth"})
    run = loop.train("grpo", cfg)
    lines = [json.loads(l) for l in (run / SAMPLES_FILE).read_text().splitlines()]
    assert len(lines) == 16
    for r in lines:
        assert set(r["rewards"]) == {"parity", "answer_prefix", "fifth"}
        assert r["rewards"]["fifth"] == 0.2
        # answer_prefix's value as returned: k / len(answer), thirds among them
        assert any(r["rewards"]["answer_prefix"] == k / m for m in range(1, 5) for k in range(m + 1)), r
        assert r["reward"] == 0.25 * r["rewards"]["parity"] + 0.75 * r["rewards"]["answer_prefix"] + 0.2
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    for step in (1, 2):
        m = next(x for x in metrics if x["step"] == step)
        rows = [r for r in lines if r["step"] == step]  # every sample of the step: 2 groups of 4
        for term in ("parity", "answer_prefix"):
            values = [r["rewards"][term] for r in rows]
            mean = sum(values) / len(values)
            std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
            assert m[f"rewards/{term}/mean"] == pytest.approx(mean)
            assert m[f"rewards/{term}/std"] == pytest.approx(std)


def test_the_command_shows_each_samples_images(tmp_path) -> None:
    """An image prompt's sample shows where its images are: a path as recorded, a data: URL by its
    kind and length (not its base64 text)."""
    url = "data:image/png;base64," + "A" * 400
    rec = dict(step=1, group=0, prompt="<|vision_start|><|image_pad|><|vision_end|>Colour?", completion="red",
               reward=1.0, advantage=0.5, finish_reason="stop", response_length=1,
               images=["/data/images/0001.png", url])
    (tmp_path / SAMPLES_FILE).write_text(json.dumps(rec) + "\n")
    res = CliRunner().invoke(app, ["samples", str(tmp_path), "--width", "0"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert "(image: /data/images/0001.png)" in res.output
    assert f"(image: data:image/png URL, {len(url)} characters)" in res.output and "AAAA" not in res.output
