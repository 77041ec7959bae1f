"""Reward servers (``http://...``, ``rldsl serve-reward``), LLM judges (``judge:URL``) and reward
models (``rm:PATH``): batched, concurrent, with clear errors. Every server here runs on
127.0.0.1, started and stopped by the test, with a bounded number of requests."""
from __future__ import annotations

import json
import math
import socket
import threading
import time
import urllib.request

import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rldsl.runtime.batch import RolloutBatch
from rldsl.runtime.errors import RewardError, RewardSpecError
from rldsl.runtime.rewards.remote import JudgeReward, ServerReward, parse_judge_score
from rldsl.runtime.rewards.server import BackgroundServer, make_app
from rldsl.runtime.rewards.functions import RewardFn


def batch_of(completions: list[str], answers: list[str], prompts: list[str] | None = None) -> RolloutBatch:
    B = len(completions)
    z = torch.zeros(B, 1, dtype=torch.long)
    return RolloutBatch(prompt_ids=z, prompt_mask=z, response_ids=z, response_mask=z,
                        logprobs=torch.zeros(B, 1), finish_reason=["stop"] * B,
                        prompts=prompts or [f"{i}+1=" for i in range(B)], completions=completions,
                        group_size=1, answers=answers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Recorder:
    """A stand-in reward server: records each request's size; ``mode`` picks its (mis)behaviour."""

    def __init__(self, mode: str = "ok", delay: float = 0.0) -> None:
        self.mode, self.delay, self.sizes, self.lock = mode, delay, [], threading.Lock()
        self.in_flight = self.max_in_flight = 0

    def app(self) -> Starlette:
        async def score(request: Request) -> JSONResponse:
            import asyncio
            body = await request.json()
            n = len(body["completions"])
            with self.lock:
                self.sizes.append(n)
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.delay)
                if self.mode == "flaky" and len(self.sizes) == 1:
                    return JSONResponse({"error": "warming up"}, status_code=503)
                if self.mode == "short":
                    return JSONResponse({"rewards": [1.0] * (n - 1)})
                if self.mode == "junk":
                    return JSONResponse({"rewards": ["high"] + [None] * (n - 1),
                                         "errors": [None, "no verdict"] + [None] * (n - 2)})
                if self.mode == "numeric_text":  # text that reads as a number, a JSON bool, a number
                    return JSONResponse({"rewards": (["1.0", True, 0.5] * n)[:n]})
                if self.mode == "nolist":
                    return JSONResponse({"result": "fine"})
                # OpenRLHF's fields must be there too
                assert body["query"] == [p + c for p, c in zip(body["prompts"], body["completions"])]
                assert body["labels"] == body["answers"]
                return JSONResponse({"rewards": [float(len(c)) for c in body["completions"]]})
            finally:
                with self.lock:
                    self.in_flight -= 1

        return Starlette(routes=[Route("/score", score, methods=["POST"])])


# ------------------------------------------------------------------------- reward servers
def test_server_scores_in_concurrent_batches_never_one_at_a_time():
    rec = Recorder(delay=0.2)
    with BackgroundServer(rec.app()) as url:
        term = ServerReward(url + "/score", batch_size=3, concurrency=4)
        completions = [str(10 ** i) for i in range(10)]
        scores = term.score_batch([""] * 10, completions, ["a"] * 10, ["stop"] * 10)
    assert scores == [float(len(c)) for c in completions]
    assert sorted(rec.sizes) == [1, 3, 3, 3]  # ceil(10 / 3) requests, not 10
    assert rec.max_in_flight >= 2  # the chunks overlapped


def test_serve_reward_app_end_to_end_with_weights_and_openrlhf_clients():
    with BackgroundServer(make_app("reward_helpers:answer_prefix")) as url:
        health = json.loads(urllib.request.urlopen(url + "/health", timeout=5).read())
        assert health == {"ok": True, "reward": "reward_helpers:answer_prefix"}
        fn = RewardFn(f"{url}/score=0.5,exact=0.5")
        out = fn.score(batch_of(["12", "13", "99"], ["12", "12", "12"]))
        assert out.rewards.tolist() == pytest.approx([1.0, 0.25, 0.0])
        assert out.components[f"{url}/score"].tolist() == pytest.approx([1.0, 0.5, 0.0])
        # an OpenRLHF client sends query = prompt + response, prompts and labels, at /get_reward
        req = urllib.request.Request(url + "/get_reward", method="POST",
                                     data=json.dumps({"query": ["1+1=12", "1+1=2"], "prompts": ["1+1=", "1+1="],
                                                      "labels": ["2", "2"]}).encode(),
                                     headers={"Content-Type": "application/json"})
        assert json.loads(urllib.request.urlopen(req, timeout=5).read())["rewards"] == [0.0, 1.0]


def test_served_reward_that_raises_gives_null_and_the_run_decides():
    with BackgroundServer(make_app("reward_helpers:explode")) as url:
        batch = batch_of(["12", "23"], ["", ""])
        with pytest.raises(RewardError, match="ZeroDivisionError"):
            RewardFn(url + "/score").score(batch)
        out = RewardFn(url + "/score", on_error="skip").score(batch)
    assert math.isnan(out.rewards[0]) and out.rewards[1] == 0.5 and out.num_errors == 1


def test_bad_request_body_is_a_400_that_says_why():
    with BackgroundServer(make_app("exact")) as url:
        req = urllib.request.Request(url + "/score", method="POST", data=b'{"completions": "x"}',
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 400 and b"list of strings" in e.value.read()


def test_server_down_is_a_start_up_error_naming_it():
    url = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(RewardSpecError) as e:  # bad input at start-up: exit code 2
        RewardFn(url)
    assert url in str(e.value) and "not reachable" in str(e.value) and "serve-reward" in str(e.value)
    # and a server that goes away mid-run: named, after the retries, whatever on_error says
    term = ServerReward(url, retries=1, backoff=0.0, check=False)
    with pytest.raises(RewardError, match=r"failed after 2 tries"):
        term.score_batch(["p"], ["c"], ["a"], ["stop"])


def test_retries_a_5xx_then_succeeds():
    rec = Recorder(mode="flaky")
    with BackgroundServer(rec.app()) as url:
        scores = ServerReward(url + "/score", retries=2, backoff=0.05).score_batch(["p"], ["abc"], ["a"], ["stop"])
    assert scores == [3.0] and len(rec.sizes) == 2


def test_time_out_is_named():
    rec = Recorder(delay=1.5)
    with BackgroundServer(rec.app()) as url:
        term = ServerReward(url + "/score", timeout=0.3, retries=0)
        t0 = time.monotonic()
        with pytest.raises(RewardError, match="timed out"):
            term.score_batch(["p"], ["c"], ["a"], ["stop"])
        assert time.monotonic() - t0 < 1.4


@pytest.mark.parametrize("mode,message", [("short", "returned 2 rewards for 3 samples"),
                                          ("nolist", "without a 'rewards' list")])
def test_protocol_violations_are_run_errors(mode, message):
    with BackgroundServer(Recorder(mode=mode).app()) as url:
        with pytest.raises(RewardError, match=message):
            RewardFn(url + "/score", on_error="skip").score(batch_of(["a", "b", "c"], ["", "", ""]))


def test_non_numbers_are_per_sample_errors():
    with BackgroundServer(Recorder(mode="junk").app()) as url:
        out = RewardFn(url + "/score", on_error="skip").score(batch_of(["a", "b", "c"], ["", "", ""]))
        assert out.num_errors == 3 and "not a number" in out.first_error
        with pytest.raises(RewardError, match="no verdict|not a number"):
            RewardFn(url + "/score").score(batch_of(["a", "b", "c"], ["", "", ""]))


def test_text_from_a_server_is_refused_as_a_functions_text_is():
    """The one check of a reward value (rewards/values.py): text, even "1.0", is not a score; a
    JSON bool is 1 or 0, as a Python function's bool is."""
    with BackgroundServer(Recorder(mode="numeric_text").app()) as url:
        out = RewardFn(url + "/score", on_error="skip").score(batch_of(["a", "b", "c"], ["", "", ""]))
        assert out.num_errors == 1 and out.rewards.tolist()[1:] == [1.0, 0.5]
        assert f"reward server {url}/score returned '1.0' (a str), not a number: text is not a score" \
            in out.first_error
        with pytest.raises(RewardError, match="returned '1.0' \\(a str\\), not a number"):
            RewardFn(url + "/score").score(batch_of(["a", "b", "c"], ["", "", ""]))


def test_bad_server_spec_words():
    with pytest.raises(ValueError, match="no option 'speed'"):
        RewardFn("http://127.0.0.1:1/score(speed=3)")
    with pytest.raises(ValueError, match="no query string"):
        ServerReward("http://127.0.0.1:1/score?x", check=False)


# ------------------------------------------------------------------------------ LLM judges
class Judge:
    """An OpenAI-compatible chat endpoint stand-in: 'Score: 9' if the reference answer appears in
    the graded answer, 'Score: 1' otherwise, and no score at all for completions saying 'mumble'."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    def app(self) -> Starlette:
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            self.requests.append(body)
            text = body["messages"][0]["content"]
            graded = text.split("Answer to grade:")[-1] if "Answer to grade:" in text else text
            answer = text.split("REF<")[1].split(">")[0] if "REF<" in text else None
            if "mumble" in graded:
                reply = "I cannot tell."
            elif answer is not None:
                reply = "Compared.\nScore: 9" if answer in graded.split("GRADED<")[1] else "Wrong.\nScore: 1"
            else:
                reply = "Looks fine.\n**Score: 7**"
            return JSONResponse({"choices": [{"message": {"role": "assistant", "content": reply}}]})

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def test_judge_with_a_template_file(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text("Reference REF<{answer}> for task {prompt}. GRADED<{completion}>. Say Score: N.")
    judge = Judge()
    with BackgroundServer(judge.app()) as url:
        fn = RewardFn(f"judge:{url}/v1(template={template}, model=tiny-judge, scale=10)", on_error="skip")
        out = fn.score(batch_of(["42", "41", "mumble"], ["42", "42", "42"]))
    assert out.rewards[:2].tolist() == pytest.approx([0.9, 0.1])
    assert math.isnan(out.rewards[2]) and "no parsable 'Score: N'" in out.first_error
    assert {r["model"] for r in judge.requests} == {"tiny-judge"} and len(judge.requests) == 3
    assert judge.requests[0]["temperature"] == 0.0


def test_judge_default_template_and_score_parsing():
    with BackgroundServer(Judge().app()) as url:
        assert JudgeReward(url + "/v1/chat/completions")("q", "a", "") == pytest.approx(0.7)
    assert parse_judge_score("reasoning... Score: 3\nScore = 8.5") == 8.5
    assert parse_judge_score(" 6 ") == 6.0
    assert parse_judge_score("no score here") is None


def test_judge_bad_template_and_unreachable_at_start_up(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("Grade {completion} against {gold}")
    with pytest.raises(ValueError, match=r"unknown field \{gold\}"):
        JudgeReward("http://127.0.0.1:1/v1", template=str(bad), check=False)
    with pytest.raises(ValueError, match="is not a file"):
        JudgeReward("http://127.0.0.1:1/v1", template=str(tmp_path / "none.txt"), check=False)
    with pytest.raises(RewardSpecError, match="judge .* is not reachable"):
        JudgeReward(f"http://127.0.0.1:{free_port()}/v1")


# --------------------------------------------------------------------------- reward models
@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification
    from rldsl.runtime import toy
    tok = toy.build_tokenizer()
    path = tmp_path_factory.mktemp("rm")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_reward_model_batches_equal_single_rows(reward_model_dir):
    fn = RewardFn(f"rm:{reward_model_dir}(batch_size=2)")
    completions, prompts = ["12", "7", "1234", "5", "99"], ["1+11=", "3+4=", "12+1222=", "2+3=", "90+9="]
    out = fn.score(batch_of(completions, [""] * 5, prompts))
    term = fn.terms[0].fn
    single = [term(p, c, "") for p, c in zip(prompts, completions)]
    assert out.rewards.tolist() == pytest.approx(single, abs=1e-5)
    assert len(set(round(x, 6) for x in single)) > 1  # a real model: different texts, different rewards


def test_reward_model_loads_without_a_transformers_progress_bar(reward_model_dir, capfd):
    from transformers.utils import logging as hf_logging
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        capfd.readouterr()
        RewardFn(f"rm:{reward_model_dir}")
    finally:
        if not was:
            hf_logging.disable_progress_bar()
    assert "Loading weights" not in capfd.readouterr().err


def test_reward_model_folder_checks(tmp_path, model_dir):
    with pytest.raises(ValueError, match="not a sequence-classification model.*LlamaForCausalLM"):
        RewardFn(f"rm:{model_dir}")
    with pytest.raises(ValueError, match="no config.json"):
        RewardFn(f"rm:{tmp_path}")


@pytest.mark.slow
def test_reward_model_on_its_own_ray_actor_scores_as_in_process(reward_model_dir):
    """rm:PATH(actor=true): the model is loaded on a Ray actor (a local Ray when none runs) on
    first use, and scores exactly what the in-process model scores."""
    import ray

    from rldsl.runtime.rewards.model import RewardModelActor

    completions, prompts = ["12", "7", "1234"], ["1+11=", "3+4=", "12+1222="]
    local = RewardFn(f"rm:{reward_model_dir}(batch_size=2)").score(batch_of(completions, [""] * 3, prompts))
    fn = RewardFn(f"rm:{reward_model_dir}(batch_size=2, actor=true)")
    term = fn.terms[0].fn
    assert isinstance(term, RewardModelActor) and term._actor is None  # nothing started before use
    try:
        out = fn.score(batch_of(completions, [""] * 3, prompts))
        assert isinstance(term._actor, ray.actor.ActorHandle)
        assert out.rewards.tolist() == pytest.approx(local.rewards.tolist(), abs=1e-6)
        assert out.num_errors == 0
        # a process reward on the actor: the same step scores as in process
        steps = [c + "+1" for c in completions]
        here = RewardFn(f"rm:{reward_model_dir}(step_separator=+)")
        local_steps = here.score(batch_of(steps, [""] * 3, prompts)).steps[here.terms[0].name]
        on_actor = RewardFn(f"rm:{reward_model_dir}(step_separator=+, actor=true)")
        got = on_actor.score(batch_of(steps, [""] * 3, prompts))
        on_actor.terms[0].fn.close()
        name = on_actor.terms[0].name
        assert [[e for e, _ in s] for s in got.steps[name]] == [[e for e, _ in s] for s in local_steps]
        assert [v for s in got.steps[name] for _, v in s] == \
            pytest.approx([v for s in local_steps for _, v in s], abs=1e-6)
    finally:
        term.close()
        ray.shutdown()


def test_reward_model_actor_checks_the_folder_at_start_up(model_dir, tmp_path):
    with pytest.raises(ValueError, match="not a sequence-classification model"):
        RewardFn(f"rm:{model_dir}(actor=true)")
    with pytest.raises(ValueError, match="no config.json"):
        RewardFn(f"rm:{tmp_path}(actor=true, num_gpus=1)")


# ------------------------------------------------------------------------------ in a run
@pytest.mark.slow
def test_a_run_trains_on_a_reward_server(model_dir, tmp_path):
    """3 steps of grpo scored by `rldsl serve-reward reward_helpers:parity` on 127.0.0.1; the
    rewards equal the function's own on the logged samples."""
    from rldsl.runtime.run import loop
    from rldsl.runtime.config import load_config
    from rldsl.runtime.records.metrics import read_metrics
    from reward_helpers import parity

    with BackgroundServer(make_app("reward_helpers:parity")) as url:
        cfg = load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'run'}", "rollout.prompts_per_step=4",
                                 "rollout.n=4", "train.steps=3", "eval.every=0", "checkpoint.every=0",
                                 "log.progress=false", f"reward.name={url}/score(batch_size=5)"])
        run = loop.train("grpo", cfg)
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["reward"] == parity("", s["completion"], "") for s in samples)


def test_serve_reward_refuses_a_time_limit_that_is_not_one() -> None:
    import subprocess
    import sys

    for value in ("-1", "inf", "nan"):
        res = subprocess.run([sys.executable, "-m", "rldsl.cli", "serve-reward", "exact", "--timeout-s", value],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and "--timeout-s must be a number of seconds >= 0" in res.stderr, res.stderr


@pytest.mark.parametrize("port", [99999, 0, -1, "taken"])
def test_serve_reward_on_a_port_it_cannot_listen_on_exits_2_saying_why(port) -> None:
    """`rldsl serve-reward --port 99999` said it served, then never listened nor exited; a port
    out of range, or one another server holds, is exit code 2 naming the port, before "serving"."""
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as holder:
        number = holder.getsockname()[1] if port == "taken" else port
        res = subprocess.run([sys.executable, "-m", "rldsl.cli", "serve-reward", "exact", "--port", str(number)],
                             capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, (res.stdout, res.stderr)
    said = f"cannot listen on 127.0.0.1:{number}: " if port == "taken" else f"--port must be in 1..65535, got {number}"
    assert said in res.stderr and "serving" not in res.stdout and "Traceback" not in res.stderr
