"""Self-distillation: the teacher is the policy itself (``teacher.self``, no gradient) or an EMA
copy of it (``teacher.ema``), scoring the sampled response tokens after a privileged prompt built
from a data column (``teacher.context_key``), through the existing ``distill`` slot. Checked
against hand-written references: a direct no-grad forward of the policy on the privileged prompt
+ the response, a separate frozen copy of the policy as teacher, the EMA formula."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import real_model as fixture
import rldsl
from rldsl.runtime.batch import repeat_each
from rldsl.runtime.data.datasets import load_examples, render_prompt
from rldsl.runtime.errors import ConfigError, DataError
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.run import loop
from rldsl.runtime.toy import build_tokenizer
from rldsl.runtime.train.teachers import ema_copy, privileged
from rldsl.runtime.train.trainer import Trainer
from small_run import small_run, steps_of, without_timing


def _direct(policy, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The reference: the policy's no-grad logprobs of ``response`` after ``prompt``, one
    unpadded row, read off the full logits."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = policy(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _rollout(policy, tokenizer, prompts=("1+2=", "33+4=")):
    return HFEngine(policy, tokenizer).generate(list(prompts), SamplingParams(n=2, temperature=1.0,
                                                                              max_new_tokens=6, seed=0))


def _rows(rollout):
    return [rollout.response_ids[b][rollout.response_mask[b].bool()].tolist() for b in range(len(rollout))]


# ------------------------------------------------------------------------------ data

def test_a_context_column_makes_the_privileged_prompt_under_a_released_chat_template(tmp_path):
    """The teacher's prompt is the row's prompt with its context column filled into
    teacher.context_template (of a chat: the last user message), rendered as the policy's prompt
    is (Qwen2.5's and Llama 3.1's released templates, Llama's BOS left to the tokenizer)."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": chat, "answer": "4", "solution": "2+2 = 4"}) + "\n"
                    + json.dumps({"prompt": "1+1=", "answer": "2", "solution": 2}) + "\n")
    rows = load_examples(path, context_field="solution")
    assert rows[1].teacher_prompt == "1+1=\n\nReference solution:\n2" and rows[1].prompt == "1+1="
    for name in ("qwen2.5", "llama3.1"):
        tok = fixture.build_tokenizer(name)
        plain = [render_prompt(e, tok) for e in load_examples(path)]
        rendered = [render_prompt(e, tok) for e in rows]
        assert [r.prompt for r in rendered] == [p.prompt for p in plain]  # the policy's prompt unchanged
        privileged_chat = [chat[0], {"role": "user", "content": "What is 2+2?\n\nReference solution:\n2+2 = 4"}]
        want = tok.apply_chat_template(privileged_chat, tokenize=False, add_generation_prompt=True)
        if tok.bos_token and want.startswith(tok.bos_token):  # the tokenizer adds it (as the policy's)
            want = want[len(tok.bos_token):]
        assert rendered[0].teacher_prompt == want
        ids = tok.apply_chat_template(privileged_chat, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in newer transformers
        assert tok(rendered[0].teacher_prompt)["input_ids"] == list(ids)  # as the engines tokenize it
    custom = load_examples(path, context_field="solution", context_template="{context} | {prompt}")
    assert custom[1].teacher_prompt == "2 | 1+1="
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: missing field 'solution'"):
        load_examples(path, context_field="solution")


# ------------------------------------------------------------------------------ the trainer

def test_a_self_teacher_is_the_policy_without_gradient_on_the_privileged_prompt(tiny_model, tokenizer):
    """teacher.self: the distill slot's teacher logprobs are exactly a direct no-grad forward of
    the current policy on each row's privileged prompt + its own sampled response."""
    policy = tiny_model
    fn = rldsl.compile(rldsl.load("opd"), compile=False)
    trainer = Trainer(fn, policy, optimizer=torch.optim.SGD(policy.parameters(), lr=0.1), teacher=policy,
                      logprob_chunk=5)
    rollout = _rollout(policy, tokenizer)
    priv = repeat_each([tokenizer("3:1+2=")["input_ids"], tokenizer("37:33+4=")["input_ids"]], 2)
    rollout.teacher_prompt_ids = priv
    batch = trainer.estimate(rollout, torch.zeros(4))
    t = batch.teacher.logprobs
    assert not t.requires_grad
    differs = 0.0  # how far the policy on its own prompt is from the privileged teacher
    for b, resp in enumerate(_rows(rollout)):
        want = _direct(policy, priv[b], resp)
        torch.testing.assert_close(t[b, :len(resp)], want, atol=1e-6, rtol=0)
        own = _direct(policy, rollout.prompt_ids[b][rollout.prompt_mask[b].bool()].tolist(), resp)
        differs = max(differs, float((own - want).abs().max()))
    assert differs > 1e-3  # the privileged prompt changes what the teacher says
    # the batch the teacher scored: the same response columns, the privileged prompts left padded
    seen = privileged(rollout)
    assert torch.equal(seen.response_ids, rollout.response_ids) and seen.teacher_prompt_ids == []
    assert [seen.prompt_ids[b][seen.prompt_mask[b].bool()].tolist() for b in range(4)] == priv


def test_no_gradient_flows_through_a_self_teacher(tiny_model, tokenizer):
    """A self-teacher's update is exactly that of a separate frozen copy of the policy as the
    teacher (gkd: the JSD over the vocabulary reads the teacher's LM head -- here the policy's
    own -- inside the update's backward)."""
    fn = rldsl.compile(rldsl.load("gkd"), compile=False)
    a = tiny_model
    b = copy.deepcopy(a)
    frozen = ema_copy(a)
    rollout = _rollout(a, tokenizer)
    rollout.teacher_prompt_ids = repeat_each([tokenizer("3:1+2=")["input_ids"],
                                              tokenizer("37:33+4=")["input_ids"]], 2)
    out = []
    for policy, teacher in ((a, a), (b, frozen)):
        trainer = Trainer(fn, policy, optimizer=torch.optim.SGD(policy.parameters(), lr=1.0), teacher=teacher)
        m = trainer.update(trainer.estimate(rollout, torch.zeros(4)))
        assert m["optimizer_steps"] == 1 and m["grad_norm"] > 0
        out.append(m["grad_norm"])
    assert out[0] == pytest.approx(out[1], rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0)


def test_the_ema_teacher_moves_toward_the_policy_after_each_optimizer_step(tiny_model, tokenizer):
    """teacher.ema: after the optimizer step, ema = decay*ema + (1-decay)*policy; its state
    round-trips through teacher_state / load_teacher_state."""
    policy = tiny_model
    fn = rldsl.compile(rldsl.load("opd"), compile=False)
    teacher = ema_copy(policy)
    with torch.no_grad():  # an EMA teacher that is not the policy (as after earlier steps)
        for p in teacher.parameters():
            p.add_(0.01 * torch.randn_like(p))
    before = [p.clone() for p in teacher.parameters()]
    trainer = Trainer(fn, policy, optimizer=torch.optim.SGD(policy.parameters(), lr=0.5), teacher=teacher,
                      teacher_ema=0.75)
    m = trainer.update(trainer.estimate(_rollout(policy, tokenizer), torch.zeros(4)))
    assert m["optimizer_steps"] == 1
    for e, e0, p in zip(teacher.parameters(), before, policy.parameters(), strict=True):
        assert not e.requires_grad
        torch.testing.assert_close(e, 0.75 * e0 + 0.25 * p.detach(), atol=1e-7, rtol=0)
    state = trainer.teacher_state()
    other = Trainer(fn, copy.deepcopy(policy), optimizer=torch.optim.SGD(policy.parameters(), lr=0.5),
                    teacher=ema_copy(policy), teacher_ema=0.75)
    other.load_teacher_state(state)
    for e, f in zip(teacher.parameters(), other.teacher.parameters(), strict=True):
        assert torch.equal(e, f)


# ------------------------------------------------------------------------------ runs

@pytest.mark.slow
def test_a_run_with_a_self_teacher_scores_each_rows_solution_prompt(model_dir, tmp_path, monkeypatch):
    """teacher.self + teacher.context_key: every step's teacher logprobs are the current policy's
    on the row's prompt rebuilt with its `solution` column (teacher.context_template)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "solution": str(a + b)}) + "\n"
                            for a in range(1, 5) for b in range(3, 7)))
    seen = []
    est = Trainer.estimate

    def estimate(self, rollout, rewards):
        want = [_direct(self.policy, rollout.teacher_prompt_ids[b], r) for b, r in enumerate(_rows(rollout))]
        out = est(self, rollout, rewards)
        seen.append((rollout, out.teacher, want))
        return out

    monkeypatch.setattr(Trainer, "estimate", estimate)
    cfg = small_run(model_dir, tmp_path / "run", **{"data.path": data, "data.eval_size": 0,
                                                       "teacher.self": "true", "teacher.context_key": "solution",
                                                       "teacher.context_template": "{context}:{prompt}"})
    run = loop.train("opd", cfg)
    assert [r["step"] for r in steps_of(run)] == [1, 2, 3]
    assert len(seen) == 3
    toy = build_tokenizer()  # the run's tokenizer (model_dir's)
    for rollout, teacher, want in seen:
        for b, prompt in enumerate(rollout.prompts):
            a, rest = prompt.split("+")
            solution = str(int(a) + int(rest.rstrip("=")))
            assert rollout.teacher_prompt_ids[b] == toy(f"{solution}:{prompt}")["input_ids"]
            n = len(want[b])
            torch.testing.assert_close(teacher.logprobs[b, :n], want[b], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_an_ema_teacher_resumes_exactly(model_dir, tmp_path):
    """teacher.ema: the EMA copy is saved with each checkpoint, so a run cut and resumed gives
    the same steps (its distill divergence reads the restored EMA teacher). grpo_distill: the task
    reward moves the policy, and the EMA teacher lags it."""
    over = {"train.steps": 4, "checkpoint.every": 2, "teacher.ema": 0.5, "train.lr": 0.05}
    full = loop.train("grpo_distill", small_run(model_dir, tmp_path / "full", **over))
    recs = steps_of(full)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[0]["distill/divergence"] == pytest.approx(0.0, abs=1e-6)  # the EMA starts as the policy
    assert recs[3]["distill/divergence"] > 1e-6  # and lags it
    cut = loop.train("grpo_distill", small_run(model_dir, tmp_path / "cut", **over), stop_after=3)
    loop.train("grpo_distill", resume=cut)
    # perf/logprobs_*: the teacher's forward is counted in the next step's report, which a resumed
    # process does not have (so with teacher.path too); every other number is the same
    assert _without_perf(steps_of(cut)) == _without_perf(recs)


def _without_perf(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in without_timing(records)]


# ------------------------------------------------------------------------------ refused at start

def test_self_teacher_settings_are_refused_before_a_model_loads(model_dir, tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr("rldsl.runtime.workers.start.master_policy", no_load)
    with pytest.raises(ConfigError, match=r"teacher.self=true: .*without teacher.context_key"):
        loop.train("opd", small_run(model_dir, tmp_path / "run", **{"teacher.self": "true"}))
    with pytest.raises(ConfigError, match=r"teacher.context_key=solution: .*data.path is not set"):
        loop.train("opd", small_run(model_dir, tmp_path / "run", **{"teacher.self": "true",
                                                                       "teacher.context_key": "solution"}))
    with pytest.raises(ConfigError, match="teacher.ema is set but grpo reads no teacher"):
        loop.train("grpo", small_run(model_dir, tmp_path / "run", **{"teacher.ema": 0.9}))
    with pytest.raises(ConfigError, match="teacher.self is set but grpo reads no teacher"):
        loop.train("grpo", small_run(model_dir, tmp_path / "run", **{"teacher.self": "true"}))
    with pytest.raises(ConfigError, match="teacher.path and teacher.self are both set"):
        small_run(model_dir, tmp_path, **{"teacher.path": model_dir, "teacher.self": "true"})
    with pytest.raises(ConfigError, match="teacher.url and teacher.ema are both set"):
        small_run(model_dir, tmp_path, **{"teacher.url": "http://127.0.0.1:9/v1", "teacher.ema": 0.9})
    for bad in ("0", "1", "1.5"):
        with pytest.raises(ConfigError, match="teacher.ema"):
            small_run(model_dir, tmp_path, **{"teacher.ema": bad})
    with pytest.raises(ConfigError, match=r"teacher.context_template='\{prompt\}' must contain"):
        small_run(model_dir, tmp_path, **{"teacher.context_template": "{prompt}"})
