"""The policy's probability of the data's reference answer (`answer_prob`, `bare_answer_prob`: RLPR):
against the authors' construction (github.com/OpenBMB/RLPR @ 8490fca, verl/trainer/ppo/ray_trainer.py
replace_answer_with_gt_batch, locate_substring_tokens, get_scoreA; verl/workers/reward_manager/prob.py
compute_scoreB) transcribed here on the tiny model, each row run alone; the settings that cannot make
it exit 2 before any model loads; a short run records it per sample and trains."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import rldsl
from rldsl.cli import app
from rldsl.runtime.batch import RolloutBatch
from rldsl.runtime.config import load_config
from rldsl.runtime.data.datasets import Example
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.resolve import check_answers
from rldsl.runtime.run import loop
from rldsl.runtime.run.plan import load_spec
from rldsl.runtime.train import inputs as producers
from rldsl.runtime.train.trainer import Trainer
from small_run import small_run, steps_of

ROOT = Path(__file__).resolve().parents[3]
SPEC = str(ROOT / "algorithms" / "examples" / "rlpr.rl")
TAGS = ("=", ":")  # tags the toy tokenizer has (its vocabulary is arithmetic)


def _authors_locate(tokenizer, full: str, sub: str, ignore_end: str) -> list[int]:
    """locate_substring_tokens: the tokens overlapping the last ``sub`` before ``ignore_end``."""
    enc = tokenizer(full, return_offsets_mapping=True, add_special_tokens=False)
    assert full.endswith(ignore_end)
    start = full[:-len(ignore_end)].rfind(sub)
    end = start + len(sub)
    return [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < end and e > start]


def _authors_score(model, tokenizer, text: str, where: list[int]) -> float:
    """The old policy's logprobs of ``text``'s tokens (the row alone), mean of exp over ``where``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    return float(torch.stack([logp[i - 1, ids[i]] for i in where]).exp().mean())


def _authors_score_b(model, tokenizer, prompt: str, completion: str, gt: str) -> float:
    """replace_answer_with_gt_batch (format_mode R1_nothink: the tags are the answer's alone), then
    compute_scoreB (mean_exp_log_softmax) without its bfloat16 rounding; 0 for an invalid row."""
    start, end = TAGS
    eos = tokenizer.eos_token
    response = completion if completion.endswith(eos) else completion + eos
    full = prompt + response
    if response.count(start) != 1:
        return 0.0
    section = response.split(start)[1]
    lead = ""
    for ch in section:
        if ch in " \n\t\r":
            lead += ch
        else:
            break
    lead = lead or " "
    new_text = start.join(full.split(start)[:-1]) + start + lead + gt + " " + end + eos
    return _authors_score(model, tokenizer, new_text, _authors_locate(tokenizer, new_text, gt, end + eos))


def _authors_score_a(model, tokenizer, prompt: str, gt: str) -> float:
    """get_scoreA: ``prompt + ' ' + gt + ' ' + eos``, the mean of exp over the answer's tokens."""
    eos = tokenizer.eos_token
    new_text = prompt + " " + gt + " " + eos
    return _authors_score(model, tokenizer, new_text, _authors_locate(tokenizer, new_text, gt, eos))


def _rollout(tokenizer, prompts: list[str], completions: list[str], G: int) -> RolloutBatch:
    """Left-padded prompts, right-padded responses (EOS-ended), as an engine returns them."""
    p_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r_ids = [tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for c in completions]
    tp, tr = max(map(len, p_ids)), max(map(len, r_ids))
    pad = tokenizer.pad_token_id
    return RolloutBatch(torch.tensor([[pad] * (tp - len(x)) + x for x in p_ids]),
                        torch.tensor([[0] * (tp - len(x)) + [1] * len(x) for x in p_ids]),
                        torch.tensor([x + [pad] * (tr - len(x)) for x in r_ids]),
                        torch.tensor([[1.0] * len(x) + [0.0] * (tr - len(x)) for x in r_ids]),
                        torch.zeros(len(r_ids), tr), ["stop"] * len(r_ids), prompts, completions, G)


def test_answer_prob_is_the_authors_score_on_the_tiny_model(tokenizer, tiny_model):
    """2 prompts x 3 rows: a reasoning then one tag (with and without a closing tag, with a space
    after the tag and without), no tag and two tags (0, as the authors' empty mask); each row's
    answer_prob equals the authors' scoreB and bare_answer_prob their scoreA, to 1e-6."""
    prompts = ["12+3", "7*6"]
    completions = ["1+2=15:", "3*4= 17", "123", "4*5=", "6=7=42", "9-1=  4)"]
    answers = ["15", "42"]
    fn = rldsl.compile(rldsl.load(SPEC), compile=False)
    trainer = Trainer(fn, tiny_model, optimizer=torch.optim.SGD(tiny_model.parameters(), lr=0.0))
    side = producers.RolloutSide(None, [], 8, print, 1, tokenizer=tokenizer, score=trainer.response_logprobs,
                                 answer_tags=TAGS)
    batch = _rollout(tokenizer, [p for p in prompts for _ in range(3)], completions, 3)
    made, seconds = producers.reference_answer_probs(side, batch, None, [Example(i, p, a) for i, (p, a) in
                                                                         enumerate(zip(prompts, answers))])
    got, bare = made.inputs["answer_prob"], made.inputs["bare_answer_prob"]
    assert got.dtype == torch.float32 and got.shape == (6,) and seconds > 0
    want = [_authors_score_b(tiny_model, tokenizer, batch.prompts[i], c, answers[i // 3])
            for i, c in enumerate(completions)]
    want_bare = [_authors_score_a(tiny_model, tokenizer, batch.prompts[i], answers[i // 3]) for i in range(6)]
    assert [w == 0.0 for w in want] == [False, False, True, False, True, False]
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(bare.double(), torch.tensor(want_bare, dtype=torch.float64), rtol=0, atol=1e-6)
    assert len(set(want_bare)) == 2 and len({round(w, 6) for w in want if w}) == 4  # rows differ


def test_bad_settings_are_refused_by_name(model_dir, tmp_path):
    spec = load_spec(SPEC)
    for sets, said in [(["data.answer_key=null"], "data.answer_key=null"),
                       (["reward.answer_tags=['', '</answer>']"], "opening tag is empty"),
                       (["rollout.env=addition_steps"], "multi-turn episodes"),
                       (["distributed.rollout_workers=1"], "Ray workers"),
                       (["rollout.max_staleness=1"], "asynchronous run")]:
        with pytest.raises(ConfigError, match=said):
            check_answers(spec, load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'run'}", *sets]))
    check_answers(spec, load_config(None, [f"model.path={model_dir}"]))
    check_answers(load_spec("grpo"), load_config(None, ["data.answer_key=null"]))  # a spec that reads none


@pytest.mark.parametrize("case", ["answer_key_null", "no_answer_column"])
def test_no_answers_in_the_data_exits_2_before_any_model_loads(model_dir, tmp_path, no_model_load, case):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1"}) for i in range(4)) + "\n")
    sets = ["data.answer_key=null"] if case == "answer_key_null" else []
    out = tmp_path / "run"
    args = ["run", SPEC, "--model", str(model_dir), "--out", str(out), "--set", f"data.path={data}",
            "--set", "reward.name=reward_helpers:parity", "--set", "log.progress=false"]
    res = CliRunner().invoke(app, args + [x for s in sets for x in ("--set", s)])
    assert res.exit_code == 2, res.output
    said = "data.answer_key=null" if case == "answer_key_null" else "line 1: missing field 'answer'"
    assert said in res.output, res.output
    assert "Traceback" not in res.output and not out.exists() and no_model_load == []


@pytest.mark.slow
def test_a_run_records_the_answer_probability_per_sample_and_trains(model_dir, tmp_path):
    """3 steps of rlpr on the built-in addition task (answer tag '+': the random model writes it
    now and then): every sample's answer_prob and bare_answer_prob in samples.jsonl, answer_prob > 0
    exactly where the completion has one tag, the bare one > 0 everywhere; finite losses;
    time/answer_s logged."""
    run = loop.train(SPEC, small_run(model_dir, tmp_path / "rlpr", "train.steps=3", "log.samples_per_step=4",
                                     "seed=3", "reward.answer_tags=['+', '']"))
    recs = steps_of(run)
    assert len(recs) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
    assert all(r["time/answer_s"] > 0 for r in recs)
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 16
    for row in rows:
        assert 0.0 < row["bare_answer_prob"] < 1.0
        one_tag = row["completion"].count("+") == 1
        assert (row["answer_prob"] > 0.0) == one_tag, row
    assert any(r["answer_prob"] > 0 for r in rows) and any(r["answer_prob"] == 0 for r in rows)
