"""A distillation teacher outside the trainer's process: on a Ray actor (``teacher.actor=true``)
or behind an OpenAI-compatible server that returns prompt logprobs (``teacher.url``). Both
return what the in-process teacher computes; every wrong set-up is refused at start (the keys
before the model loads, a server when the trainer is built), and a server that fails mid-run
stops the run with the reason -- never a silent 0.

The server here is a stand-in that answers as vLLM's /v1/completions does (prompt_logprobs: at
each position the logprob of the token there and of the k most likely ones with their ranks;
more than ``max_logprobs`` refused with HTTP 400), computed with the teacher model itself;
tests/runtime/train/test_teacher_vllm.py runs vLLM's own server.
"""
from __future__ import annotations

import math

import pytest
import torch

from rldsl.runtime.errors import ConfigError, TeacherError
from rldsl.runtime.models.loading import load_policy, load_tokenizer
from rldsl.runtime.rewards.server import BackgroundServer
from rldsl.runtime.run import loop
from rldsl.runtime.train.teachers import TeacherActor, TeacherHead, head_parts, teacher_topk, vocabulary_jsd
from rldsl.runtime.train.trainer import Trainer
from small_run import small_run, steps_of


@pytest.fixture(scope="module")
def teacher_dir():
    from rldsl.runtime.toy import warm_start
    return warm_start()  # the embedded warm model: the toy's vocabulary


def stand_in_app(teacher_dir, *, max_logprobs: int = 5, fault: str | None = None):
    """vLLM's /v1/models, /tokenize and /v1/completions (prompt_logprobs) answered from the
    teacher model; ``fault``: "short" (one prompt logprob too few), "few" (k - 1 top logprobs),
    "vocab" (top ids beyond the vocabulary), "tokenizer" (/tokenize gives other ids)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    model = load_policy(teacher_dir, "float32").eval()
    tok = load_tokenizer(teacher_dir)
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "teacher", "object": "model"}]}

    @app.post("/tokenize")
    def tokenize(body: dict):
        ids = tok(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        return {"tokens": [(i + 1) % len(tok) for i in ids] if fault == "tokenizer" else ids}

    @app.post("/v1/completions")
    def completions(body: dict):
        k = int(body.get("prompt_logprobs") or 0)
        if k > max_logprobs:
            return JSONResponse({"error": {"message": f"Requested prompt logprobs of {k}, which is greater than "
                                                      f"max allowed: {max_logprobs}", "code": 400}}, status_code=400)
        choices = []
        for i, ids in enumerate(body["prompt"]):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()  # [L, V]
            logp = torch.log_softmax(logits, -1)
            entries = [None]
            for t in range(1, len(ids)):
                row = logp[t - 1]
                order = torch.argsort(row, descending=True)
                ranks = {int(v): r + 1 for r, v in enumerate(order.tolist())}
                kk = k - 1 if fault == "few" else k
                keep = order[:kk].tolist() + [ids[t]]
                shift = len(tok) if fault == "vocab" else 0  # ids of a larger vocabulary
                entries.append({str(v + shift * (v != ids[t])): {"logprob": float(row[v]), "rank": ranks[v],
                                                                  "decoded_token": tok.decode([v])}
                                for v in keep})
            if fault == "short":
                entries = entries[:-1]
            choices.append({"index": i, "text": "", "prompt_logprobs": entries, "finish_reason": "length"})
        return {"id": "cmpl", "object": "text_completion", "model": "teacher", "choices": choices}

    return app


# ------------------------------------------------------------------------------ runs

def _capture(monkeypatch):
    seen = []
    est = Trainer.estimate

    def estimate(self, rollout, rewards):
        out = est(self, rollout, rewards)
        seen.append((rollout, out.teacher, self.teacher))
        return out

    monkeypatch.setattr(Trainer, "estimate", estimate)
    return seen


def _in_process(teacher_dir, rollout, k, hidden=False):
    """The in-process teacher's (logprobs, top-k logprobs, ids[, hidden]) of the same rollout."""
    import contextlib
    model = load_policy(teacher_dir, "float32").eval()
    return teacher_topk(model, rollout, k, temperature=1.0, chunk=1024, group_size=None,
                        autocast=contextlib.nullcontext(), hidden=hidden)


def _same_as_in_process(seen, teacher_dir, k, atol, hidden=False):
    for rollout, t, _ in seen:
        lp, top, ids, *h = _in_process(teacher_dir, rollout, k, hidden)
        m = rollout.response_mask.bool()
        assert torch.allclose(t.logprobs[m], lp[m], atol=atol)
        if k:
            assert torch.allclose(t.topk_logprobs[m], top[m], atol=atol)
            assert torch.equal(t.topk_ids[m], ids[m])
        else:
            assert t.topk_ids is None
        if hidden:  # the JSD's side of the teacher: its last hidden states at every trained token
            # (|h| ~ 3, float32 over another batch shape: 1e-5 relative)
            assert t.hidden is not None and torch.allclose(t.hidden[m], h[0][m], rtol=1e-5, atol=1e-5)
        else:
            assert t.hidden is None


@pytest.mark.slow
@pytest.mark.parametrize("name,k", [("opd", 0), ("grpo_distill", 0), ("distill_topk", 16), ("gkd", 0)])
def test_three_steps_with_the_teacher_on_a_ray_actor(name, k, model_dir, teacher_dir, tmp_path, monkeypatch):
    """teacher.actor=true: the teacher is loaded on its own Ray actor (a local Ray on 127.0.0.1,
    one actor) and returns exactly the in-process teacher's logprobs and top-k."""
    import ray

    seen = _capture(monkeypatch)
    started = []
    topk = TeacherActor.topk

    def traced(self, *a):
        started.append(isinstance(self._started(), ray.actor.ActorHandle))
        return topk(self, *a)

    monkeypatch.setattr(TeacherActor, "topk", traced)
    try:
        run = loop.train(name, small_run(model_dir, tmp_path / "run", **{"teacher.path": teacher_dir,
                                                                          "teacher.actor": "true"}))
        teacher = seen[0][2]  # the trainer's teacher: the actor's client; its actor started, then
        assert isinstance(teacher, TeacherActor) and started and all(started)  # stopped with the run
        assert teacher._actor is None
    finally:
        ray.shutdown()
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["distill/divergence"] > 0 and math.isfinite(r["grad_norm"]) for r in recs)
    assert all(0 < r["time/teacher_s"] < r["time/logprobs_s"] for r in recs)  # the actor's calls, timed
    _same_as_in_process(seen, teacher_dir, 16 if k else 0, atol=1e-6, hidden=name == "gkd")


def test_the_copied_lm_head_gives_the_in_process_teachers_jsd(teacher_dir, tokenizer, tiny_model_factory):
    """gkd with teacher.actor: the trainer holds the teacher's LM head (TeacherHead, built from
    what the actor sends) and its hidden states; the JSD through them is the in-process teacher's,
    exactly, gradient included -- also for a teacher whose config scales and caps its logits."""
    teacher = load_policy(teacher_dir, "float32").eval()
    student = tiny_model_factory(tokenizer, seed=1)
    assert student.config.vocab_size == teacher.config.vocab_size
    torch.manual_seed(0)
    H_s, H_t = student.config.hidden_size, teacher.config.hidden_size
    for config in ({}, {"final_logit_softcapping": 3.0, "logit_scale": 0.7}):
        for key, value in config.items():
            setattr(teacher.config, key, value)
        head = TeacherHead(*head_parts(teacher))
        assert head.lm_head.weight.data_ptr() != teacher.get_output_embeddings().weight.data_ptr()
        h = torch.randn(12, H_s, requires_grad=True)
        t_h = torch.randn(12, H_t)
        out = []
        for who in (teacher, head):
            h.grad = None
            d = vocabulary_jsd(student, who, h, t_h, beta=0.5, temperature=0.9, chunk=5)
            d.sum().backward()
            out.append((d.detach(), h.grad.clone()))
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
        assert out[0][0].abs().sum() > 0
        for key in config:
            delattr(teacher.config, key)


TOPK4 = 'algorithm topk4 extends distill_topk\n  "Top-4 forward KL."\n  distill forward_kl_topk(k=4, task=false)\n'


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 4])
def test_three_steps_with_the_teacher_behind_a_server(k, model_dir, teacher_dir, tmp_path, monkeypatch):
    """teacher.url: every row goes to /v1/completions as a token-id prompt; the teacher's logprobs
    and top-k read from its prompt_logprobs equal the in-process teacher's (opd; a top-4 spec)."""
    seen = _capture(monkeypatch)
    spec = "opd"
    if k:
        spec = str(tmp_path / "topk4.rl")
        (tmp_path / "topk4.rl").write_text(TOPK4)
    with BackgroundServer(stand_in_app(teacher_dir)) as url:
        run = loop.train(spec, small_run(model_dir, tmp_path / "run", **{"teacher.url": url + "/v1"}))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["distill/divergence"] > 0 for r in recs)
    assert all(0 < r["time/teacher_s"] < r["time/logprobs_s"] for r in recs)  # the server's answers, timed
    _same_as_in_process(seen, teacher_dir, k, atol=1e-5)


# ------------------------------------------------------------------------------ bad input

def _no_model_load(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr("rldsl.runtime.workers.start.master_policy", no_load)


def _spec(tmp_path, text=TOPK4):
    (tmp_path / "spec.rl").write_text(text)
    return str(tmp_path / "spec.rl")


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_teacher_is_refused_naming_both_keys(model_dir, tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    with pytest.raises(ConfigError, match=r"opd: distill reverse_kl learns from a teacher, and teacher.path is not "
                                          r"set \(nor teacher.url, teacher.self, teacher.ema\): give teacher.path=.*teacher.url="):
        loop.train("opd", small_run(model_dir, tmp_path / "run"))
    with pytest.raises(ConfigError, match="teacher.url is set but grpo reads no teacher"):
        loop.train("grpo", small_run(model_dir, tmp_path / "run", **{"teacher.url": "http://127.0.0.1:9/v1"}))


def test_teacher_keys_that_contradict_each_other_are_refused(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="teacher.path and teacher.url are both set"):
        small_run(model_dir, tmp_path, **{"teacher.path": model_dir, "teacher.url": "http://127.0.0.1:9/v1"})
    with pytest.raises(ConfigError, match="teacher.actor=true runs the model of teacher.path.*not set"):
        small_run(model_dir, tmp_path, **{"teacher.actor": "true"})


def test_a_teacher_server_cannot_give_a_jsd_over_the_vocabulary(model_dir, tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    with pytest.raises(ConfigError, match=r"gkd: distill jsd reads the teacher's hidden states and LM head, and "
                                          r"teacher.url returns logprobs only: give teacher.path \(in the trainer's "
                                          r"process, or on a Ray actor with teacher.actor=true\)"):
        loop.train("gkd", small_run(model_dir, tmp_path / "run", **{"teacher.url": "http://127.0.0.1:9/v1"}))


def test_a_teacher_server_that_is_down_is_refused_at_start(model_dir, tmp_path, monkeypatch):
    url = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(ConfigError, match=rf"teacher.url={url} is not reachable .*is the server running"):
        loop.train("opd", small_run(model_dir, tmp_path / "run", **{"teacher.url": url}))


def test_a_server_teacher_needs_temperature_one(model_dir, tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    with pytest.raises(ConfigError, match=r"prompt logprobs are at temperature 1 .*rollout.temperature=0.7"):
        loop.train("opd", small_run(model_dir, tmp_path / "run", **{"teacher.url": "http://127.0.0.1:9/v1",
                                                                     "rollout.temperature": 0.7}))


def test_top_k_beyond_what_the_server_returns_is_refused_at_start(model_dir, teacher_dir, tmp_path, monkeypatch):
    """k = 8 from a server that returns at most 5 (vLLM's --max-logprobs answers HTTP 400); and a
    server that returns fewer top logprobs than asked, without saying so."""
    spec = _spec(tmp_path, TOPK4.replace("k=4", "k=8"))
    with BackgroundServer(stand_in_app(teacher_dir, max_logprobs=5)) as url:
        with pytest.raises(ConfigError, match=r"topk4: the teacher server does not return top-8 prompt logprobs: "
                                              r".*HTTP 400.*greater than max allowed: 5"):
            loop.train(spec, small_run(model_dir, tmp_path / "run", **{"teacher.url": url + "/v1"}))
    with BackgroundServer(stand_in_app(teacher_dir, fault="few")) as url:
        with pytest.raises(ConfigError, match=r"returned 3 top logprobs at a position and the spec asks for k=4"):
            loop.train(_spec(tmp_path), small_run(model_dir, tmp_path / "run", **{"teacher.url": url + "/v1"}))


def test_a_server_with_another_tokenizer_is_refused_at_start(model_dir, teacher_dir, tmp_path, monkeypatch):
    with BackgroundServer(stand_in_app(teacher_dir, fault="tokenizer")) as url:
        with pytest.raises(ConfigError, match=r"serves 'teacher' with another tokenizer than the policy's: .*a "
                                              r"teacher scores the policy's token ids"):
            loop.train("opd", small_run(model_dir, tmp_path / "run", **{"teacher.url": url + "/v1"}))


def _rollout(tok):
    from rldsl.runtime.batch import RolloutBatch
    p = torch.tensor([tok("12+34=", add_special_tokens=False)["input_ids"]] * 2)
    r = torch.tensor([tok("46", add_special_tokens=False)["input_ids"]] * 2)
    return RolloutBatch(prompt_ids=p, prompt_mask=torch.ones_like(p), response_ids=r,
                        response_mask=torch.ones_like(r), logprobs=torch.zeros(r.shape), finish_reason=["stop"] * 2,
                        prompts=["12+34="] * 2, completions=["46"] * 2, group_size=2)


@pytest.mark.parametrize("fault,message", [
    ("short", r"returned 7 prompt logprobs for a prompt of 8 tokens"),
    ("few", r"returned 3 top logprobs at a position and the spec asks for k=4"),
    ("vocab", r"returned token id \d+, beyond the policy's vocabulary of \d+: it serves another model"),
])
def test_a_server_that_answers_wrongly_mid_run_stops_it(fault, message, teacher_dir):
    """What the start-up probe cannot see: a server that later answers outside the protocol."""
    from rldsl.runtime.train.teachers import TeacherServer

    tok = load_tokenizer(teacher_dir)
    batch = _rollout(tok)
    with BackgroundServer(stand_in_app(teacher_dir, fault=fault)) as url:
        server = TeacherServer(url + "/v1", model=None, timeout_s=30, rows_per_request=16, vocab_size=len(tok))
        with pytest.raises(TeacherError, match=message):
            server.topk(batch, 4, 1.0, None)


def test_a_server_that_goes_down_mid_run_stops_it(teacher_dir):
    from rldsl.runtime.train.teachers import TeacherServer

    tok = load_tokenizer(teacher_dir)
    with BackgroundServer(stand_in_app(teacher_dir)) as url:
        server = TeacherServer(url + "/v1", model=None, timeout_s=5, rows_per_request=16)
        lp, top, ids = server.topk(_rollout(tok), 2, 1.0, None)
        assert lp.shape == (2, 2) and top.shape == ids.shape == (2, 2, 2)
    with pytest.raises(TeacherError, match=rf"teacher.url {url}/v1/completions failed after 3 tries: .*refused"):
        server.topk(_rollout(tok), 2, 1.0, None)
