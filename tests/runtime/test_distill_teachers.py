"""A distillation teacher outside the trainer's process: on a Ray actor (``teacher.actor=true``)
or behind an OpenAI-compatible server that returns prompt logprobs (``teacher.url``). Both
return what the in-process teacher computes; every wrong set-up is refused before the model
loads, and a server that fails mid-run stops the run with the reason -- never a silent 0.

The server here is a stand-in that answers as vLLM's /v1/completions does (prompt_logprobs: at
each position the logprob of the token there and of the k most likely ones with their ranks;
more than ``max_logprobs`` refused with HTTP 400), computed with the teacher model itself;
tests/runtime/test_teacher_vllm.py runs vLLM's own server.
"""
from __future__ import annotations

import math

import pytest
import torch

from rldsl.runtime.errors import ConfigError, TeacherError
from rldsl.runtime.models.loading import load_policy, load_tokenizer
from rldsl.runtime.rewards.server import BackgroundServer
from rldsl.runtime.run import loop
from rldsl.runtime.train.teachers import TeacherActor, teacher_topk
from rldsl.runtime.train.trainer import Trainer
from test_loop import quick_config, steps_of


@pytest.fixture(autouse=True)
def _eager(monkeypatch):
    monkeypatch.setenv("RLDSL_COMPILE", "0")


@pytest.fixture(scope="module")
def teacher_dir():
    from rldsl.runtime.toy import warm_start
    return warm_start()  # the embedded warm model: the toy's vocabulary


def stand_in_app(teacher_dir, *, max_logprobs: int = 5, fault: str | None = None):
    """vLLM's /v1/models, /tokenize and /v1/completions (prompt_logprobs) answered from the
    teacher model; ``fault``: "short" (one prompt logprob too few), "few" (k - 1 top logprobs)."""
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
        return {"tokens": tok(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]}

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
                entries.append({str(v): {"logprob": float(row[v]), "rank": ranks[v], "decoded_token": tok.decode([v])}
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


def _in_process(teacher_dir, rollout, k):
    """The in-process teacher's (logprobs, top-k logprobs, ids) of the same rollout."""
    import contextlib
    model = load_policy(teacher_dir, "float32").eval()
    return teacher_topk(model, rollout, k, temperature=1.0, chunk=1024, group_size=None,
                        autocast=contextlib.nullcontext())


def _same_as_in_process(seen, teacher_dir, k, atol):
    for rollout, t, _ in seen:
        lp, top, ids = _in_process(teacher_dir, rollout, k)
        m = rollout.response_mask.bool()
        assert torch.allclose(t.logprobs[m], lp[m], atol=atol)
        if k:
            assert torch.allclose(t.topk_logprobs[m], top[m], atol=atol)
            assert torch.equal(t.topk_ids[m], ids[m])
        else:
            assert t.topk_ids is None


@pytest.mark.slow
@pytest.mark.parametrize("name,k", [("opd", 0), ("distill_topk", 16)])
def test_three_steps_with_the_teacher_on_a_ray_actor(name, k, model_dir, teacher_dir, tmp_path, monkeypatch):
    """teacher.actor=true: the teacher is loaded on its own Ray actor (a local Ray on 127.0.0.1,
    one actor) and returns exactly the in-process teacher's logprobs and top-k."""
    import ray

    seen = _capture(monkeypatch)
    try:
        run = loop.train(name, quick_config(model_dir, tmp_path / "run", **{"teacher.path": teacher_dir,
                                                                          "teacher.actor": "true"}))
        teacher = seen[0][2]  # the trainer's teacher: the actor's client, its actor started
        assert isinstance(teacher, TeacherActor) and isinstance(teacher._actor, ray.actor.ActorHandle)
    finally:
        ray.shutdown()
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["distill/divergence"] > 0 and math.isfinite(r["grad_norm"]) for r in recs)
    _same_as_in_process(seen, teacher_dir, 16 if k else 0, atol=1e-6)


TOPK4 = 'algorithm topk4 extends distill_topk\n  "Top-4 forward KL."\n  distill forward_kl_topk(k=4, task=false)\n'


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
        run = loop.train(spec, quick_config(model_dir, tmp_path / "run", **{"teacher.url": url + "/v1"}))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["distill/divergence"] > 0 for r in recs)
    _same_as_in_process(seen, teacher_dir, k, atol=1e-5)
