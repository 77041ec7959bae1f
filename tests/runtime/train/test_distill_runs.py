"""Distillation in the runtime: the teacher of ``teacher.path`` scores every rollout (its logprobs
of the sampled tokens, or its top-k), the update gathers the policy's logprobs of the teacher's
top-k tokens, and a spec that needs a teacher without one -- or a teacher with another
vocabulary, or a top-k beyond it -- is refused before any model loads."""
from __future__ import annotations

import json
import math

import pytest
import torch

import rldsl
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.run import loop
from rldsl.runtime.toy import warm_start
from rldsl.runtime.train.trainer import Trainer
from small_run import small_run, steps_of


@pytest.fixture(scope="module")
def teacher_dir():
    return warm_start()  # the embedded warm model: the toy's vocabulary


@pytest.mark.slow
@pytest.mark.parametrize("name", ["opd", "distill_topk", "grpo_distill", "gkd"])
def test_distillation_specs_train_three_steps_with_the_warm_model_teaching(name, model_dir, teacher_dir,
                                                                          tmp_path, monkeypatch):
    seen = []
    est = Trainer.estimate

    def estimate(self, rollout, rewards):
        out = est(self, rollout, rewards)
        seen.append(out.teacher)
        return out

    monkeypatch.setattr(Trainer, "estimate", estimate)
    run = loop.train(name, small_run(model_dir, tmp_path / "run", **{"teacher.path": teacher_dir}))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["optimizer_steps"] == 1 and math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert r["distill/divergence"] > 0  # a random student is far from the warm teacher
        assert 0 < r["time/teacher_s"] < r["time/logprobs_s"]  # the teacher's share of the estimate
    assert len(seen) == 3
    for t in seen:  # B = 16 rows; the teacher's logprobs of the sampled tokens are logprobs
        assert t is not None and t.logprobs.shape[0] == 16 and bool((t.logprobs <= 0).all())
    k = rldsl.compile(rldsl.load(name), compile=False).data.teacher_topk
    if k is None:
        assert seen[0].topk_ids is None
    else:  # the teacher's top-k: k sorted logprobs per position, their ids distinct
        t = seen[0]
        assert t.topk_logprobs.shape == (*t.logprobs.shape, k)
        assert bool((t.topk_logprobs[..., :-1] >= t.topk_logprobs[..., 1:]).all())
        assert all(len(set(row.tolist())) == k for row in t.topk_ids.reshape(-1, k))
        assert 0 < recs[0]["distill/teacher_mass"] <= 1 + 1e-6


@pytest.mark.slow
def test_a_teacher_equal_to_the_student_gives_zero_divergence(model_dir, tmp_path):
    run = loop.train("opd", small_run(model_dir, tmp_path / "run", **{"teacher.path": model_dir}))
    recs = steps_of(run)
    assert len(recs) == 3
    for r in recs:  # zero advantages, zero gradient: the student stays the teacher
        assert r["distill/divergence"] == pytest.approx(0.0, abs=1e-6)
        assert r["loss"] == pytest.approx(0.0, abs=1e-6) and r["grad_norm"] == pytest.approx(0.0, abs=1e-6)


def test_no_teacher_is_refused_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr("rldsl.runtime.workers.start.master_policy", no_load)
    with pytest.raises(ConfigError, match=r"opd: distill reverse_kl learns from a teacher, and teacher.path "
                                          r"is not set"):
        loop.train("opd", small_run(model_dir, tmp_path / "run"))
    with pytest.raises(ConfigError, match="teacher.path is set but grpo reads no teacher"):
        loop.train("grpo", small_run(model_dir, tmp_path / "run", **{"teacher.path": model_dir}))
    with pytest.raises(ConfigError, match="teacher.path=.*nowhere: not found"):
        loop.train("opd", small_run(model_dir, tmp_path / "run", **{"teacher.path": tmp_path / "nowhere"}))
    with pytest.raises(ConfigError, match="runs in the trainer's process for now"):
        loop.train("opd", small_run(model_dir, tmp_path / "run", **{"teacher.path": model_dir,
                                                                       "distributed.trainers": 2}))


def test_a_teacher_with_another_vocabulary_is_refused(model_dir, tmp_path, tokenizer, tiny_model_factory):
    other = tmp_path / "other"
    model = tiny_model_factory(tokenizer, seed=1)
    model.resize_token_embeddings(len(tokenizer) + 5)
    model.save_pretrained(other)
    with pytest.raises(ConfigError, match=r"vocabulary of 28 tokens and the policy 23"):
        loop.train("opd", small_run(model_dir, tmp_path / "run", **{"teacher.path": other}))
    tokenizer.save_pretrained(other)
    vocab = json.loads((other / "tokenizer.json").read_text())
    m = vocab["model"]["vocab"]
    m["0"], m["1"] = m["1"], m["0"]  # two digits swap ids
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    model = tiny_model_factory(tokenizer, seed=1)
    model.save_pretrained(other)
    with pytest.raises(ConfigError, match=r"its tokenizer maps tokens to other ids than the policy's \('0' is "
                                          r"policy id (\d+), teacher id (\d+); '1' is policy id \2, teacher id \1\)"):
        loop.train("opd", small_run(model_dir, tmp_path / "run", **{"teacher.path": other}))


def test_top_k_beyond_the_vocabulary_is_refused(model_dir, teacher_dir, tmp_path):
    spec = tmp_path / "big_k.rl"
    spec.write_text('algorithm big_k extends distill_topk\n  "k beyond the toy vocabulary"\n'
                    '  distill forward_kl_topk(k=64, task=false)\n')
    with pytest.raises(ConfigError, match="top-k of 64 tokens per position, but the teacher's vocabulary has 23"):
        loop.train(str(spec), small_run(model_dir, tmp_path / "run", **{"teacher.path": teacher_dir}))


def test_the_updates_divergence_is_the_jsd_of_the_full_logits(model_dir, teacher_dir, tmp_path, tokenizer):
    """The trainer's JSD input (student hidden states with gradient, the teacher's stored at
    estimate time, both heads in chunks) equals the naive JSD of both models' full logits at the
    response positions, and its gradient reaches the student."""
    from rldsl.runtime.batch import model_inputs, position_ids_from_mask
    from rldsl.runtime.models.loading import load_policy
    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.rollout.engines.hf import HFEngine
    from rldsl.components.distill import generalized_jsd

    fn = rldsl.compile(rldsl.loads('algorithm g extends gkd\n  "t"\n  distill jsd(beta=0.3, temperature=1.5, task=false)\n',
                                   "g.rl"), compile=False)
    student, teacher = load_policy(model_dir, "float32"), load_policy(teacher_dir, "float32").eval()
    trainer = Trainer(fn, student, optimizer=torch.optim.SGD(student.parameters(), lr=0.0), teacher=teacher,
                      logprob_chunk=5)
    rollout = HFEngine(student, tokenizer).generate(["1+2=", "33+4="], SamplingParams(n=2, temperature=1.0,
                                                                                      max_new_tokens=6, seed=0))
    batch = trainer.estimate(rollout, torch.zeros(4))
    rows, Tr = torch.arange(4), rollout.response_ids.shape[1]
    hidden = trainer._logprobs(student, rollout, grad=True, entropy=False, hidden=True).hidden
    d = trainer._divergence(hidden, batch, rows, Tr)
    ids, attn, _ = model_inputs(rollout)
    pos = position_ids_from_mask(attn)
    full = lambda m: m(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -Tr - 1:-1]  # noqa: E731
    with torch.no_grad():
        want = generalized_jsd(full(student), full(teacher), 0.3, 1.5)
    valid = rollout.response_mask > 0
    torch.testing.assert_close(d[valid], want[valid], atol=1e-5, rtol=1e-5)
    (d * valid).sum().backward()
    assert student.lm_head.weight.grad is not None and float(student.lm_head.weight.grad.abs().sum()) > 0
