"""The two HTTP servers -- ``rldsl serve-reward`` (rewards/server.py) and the agent endpoint
(rollout/agents/server.py) -- answer every malformed request with a 4xx, never a 500, and keep
serving: hypothesis sends each server bad JSON, bodies of the wrong shape and types, missing
fields, huge and negative numbers, out-of-vocabulary token ids, wrong methods and routes, over
a real loopback socket; a good request after them is answered as before."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rldsl.runtime.batch import RolloutBatch
from rldsl.runtime.rewards.server import BackgroundServer, make_app
from rldsl.runtime.rollout.agents.server import PolicyServer
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.toy.tool_model import build_tool_tokenizer

#: a few hundred examples over both servers, each test well under a minute
EXAMPLES = settings(max_examples=100, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

NUMBERS = st.one_of(st.integers(min_value=-2**70, max_value=2**70), st.sampled_from([-1, 0, 2**31, 2**63, 10**30]),
                    st.floats(allow_nan=False), st.booleans())
SCALARS = st.one_of(st.none(), NUMBERS, st.text(max_size=20))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=4), max_leaves=12)


def _fields(keys: list[str], values: st.SearchStrategy) -> st.SearchStrategy:
    """An object holding any of ``keys`` (missing ones left out) with values of any shape."""
    return st.dictionaries(st.sampled_from(keys), values, max_size=len(keys))


def _raw(value: object) -> bytes:
    return json.dumps(value).encode()


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


BAD_BYTES = st.one_of(st.binary(max_size=40), st.just(b"{"), st.just(b"\xff\xfe"), st.just(b'{"a": 1}x'),
                      st.just(_deep(5000)), st.just(b"1" * 5000), st.just(b""))


class Client:
    """One keep-alive connection to a server at ``url`` (the connection is remade if the server closed it)."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname, u.port
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)

    def send(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        for attempt in range(2):
            try:
                self.conn.request(method, path, body, headers)
                reply = self.conn.getresponse()
                return reply.status, reply.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.conn.close()


def _no_500(status: int, answer: bytes, request: object) -> None:
    assert status < 500, f"HTTP {status} for {repr(request)[:300]}: {answer[:300]!r}"


# ------------------------------------------------------------------------------- serve-reward
REWARD_KEYS = ["completions", "prompts", "answers", "finish_reasons", "query", "labels"]
REWARD_BODIES = st.one_of(
    _fields(REWARD_KEYS, JSON).map(_raw),
    _fields(REWARD_KEYS, st.lists(SCALARS, max_size=4)).map(_raw),
    JSON.map(_raw),
    BAD_BYTES,
)


@pytest.fixture(scope="module")
def reward_server():
    with BackgroundServer(make_app("exact")) as url:
        client = Client(url)
        yield client
        client.close()


@EXAMPLES
@given(body=REWARD_BODIES, path=st.sampled_from(["/score", "/get_reward"]))
def test_the_reward_server_answers_malformed_bodies_with_4xx(reward_server, body: bytes, path: str) -> None:
    status, answer = reward_server.send("POST", path, body)
    _no_500(status, answer, body)
    if status == 200:  # a body that happened to be a valid request: scored
        assert isinstance(json.loads(answer)["rewards"], list)


@EXAMPLES
@given(method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST"]),
       path=st.sampled_from(["/score", "/get_reward", "/health", "/", "/scores", "/score/x", "/v1/completions"]))
def test_the_reward_server_answers_wrong_methods_and_routes_with_4xx(reward_server, method: str, path: str) -> None:
    status, answer = reward_server.send(method, path, b"{}" if method != "GET" else None)
    good = {("GET", "/health"), ("POST", "/score"), ("POST", "/get_reward")}
    if (method, path) in good:
        assert status in (200, 400)  # POST {} names no completions: 400
    else:
        assert 400 <= status < 500, (method, path, status)


def test_the_reward_server_refuses_the_malformed_requests_that_were_500s(reward_server) -> None:
    """The five bodies that raised inside the server (HTTP 500) before: each is a 400 naming the field."""
    for body, field in [({"query": 5}, "query"), ({"query": None}, "query"), ({"query": [1, 2]}, "query"),
                        ({"query": ["ab"], "prompts": [7]}, "prompts"), ({"query": ["ab"], "prompts": "a"}, "prompts")]:
        status, answer = reward_server.send("POST", "/score", _raw(body))
        assert status == 400 and field in json.loads(answer)["error"], (body, status, answer)
    for raw in (_deep(5000), b"1" * 5000):  # too deep for json, too long a number
        assert reward_server.send("POST", "/score", raw)[0] == 400


def test_the_reward_server_still_serves_after_malformed_requests(reward_server) -> None:
    for body in (b"{", _raw({"query": 5}), _deep(5000)):
        assert reward_server.send("POST", "/score", body)[0] == 400
    status, answer = reward_server.send("POST", "/score", _raw({"completions": ["4", "5"], "answers": ["4", "4"]}))
    assert status == 200 and json.loads(answer)["rewards"] == [1.0, 0.0]


# ------------------------------------------------------------------------------- agent endpoint
class Fixed:
    """An engine that answers every prompt with the same two tokens and EOS (logprob -0.5 each)."""

    def __init__(self, tok) -> None:
        self.tokenizer = tok
        self.ids = tok("12", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def generate_ids(self, prompt_ids, params, prompts=None) -> RolloutBatch:
        B, T = len(prompt_ids) * params.n, len(self.ids)
        ids = torch.tensor([self.ids] * B)
        mask = torch.ones(B, T, dtype=torch.long)
        return RolloutBatch(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long), ids, mask,
                            -0.5 * mask.float(), ["stop"] * B, [""] * B, ["12"] * B, params.n)


AGENT_ROUTES = ["/chat/completions", "/completions", "/models"]
AGENT_KEYS = ["model", "token_ids", "prompt", "messages", "sampling_params", "max_tokens", "n", "stop",
              "stop_token_ids", "logprobs", "metadata", "stream", "tools"]
IDS = st.lists(st.one_of(st.integers(min_value=-2**64, max_value=2**64), st.integers(min_value=0, max_value=40)),
               max_size=6)


def _agent_bodies(tok_vocab: int) -> st.SearchStrategy:
    ids = st.one_of(IDS, st.lists(st.integers(min_value=tok_vocab, max_value=tok_vocab + 5), min_size=1, max_size=3))
    model = st.sampled_from(["toy", "gpt-4o", 5])
    value = st.one_of(JSON, ids)
    sampling = _fields(["max_tokens", "n", "stop", "stop_token_ids", "temperature"], st.one_of(NUMBERS, ids, JSON))
    shaped = st.fixed_dictionaries({"model": model}, optional={
        "token_ids": value, "prompt": st.one_of(value, st.text(max_size=10)), "sampling_params": st.one_of(sampling, JSON),
        "messages": st.one_of(JSON, st.lists(_fields(["role", "content", "tool_calls"], JSON), max_size=3)),
        "max_tokens": st.one_of(NUMBERS, JSON), "n": NUMBERS, "stop": value, "stop_token_ids": value,
        "logprobs": SCALARS, "metadata": JSON, "stream": SCALARS, "tools": JSON})
    return st.one_of(shaped.map(_raw), _fields(AGENT_KEYS, JSON).map(_raw), BAD_BYTES)


@pytest.fixture(scope="module")
def agent_server():
    tok = build_tool_tokenizer()
    server = PolicyServer(tok, model_name="toy", context=64, max_calls=10**6, max_parallel=64)
    server.start()
    server.use(Fixed(tok), SamplingParams(n=1, max_new_tokens=4), 0)
    log = server.open_episode(3600.0)
    client = Client(server.base_url)
    yield client, urlsplit(server.episode_url(log.id)).path, len(tok)
    client.close()
    server.close()


@EXAMPLES
@given(data=st.data())
def test_the_agent_endpoint_answers_malformed_requests_with_4xx(agent_server, data) -> None:
    client, base, vocab = agent_server
    route = data.draw(st.sampled_from(AGENT_ROUTES + ["/inference/v1/generate"]))
    body = data.draw(_agent_bodies(vocab))
    path = base.removesuffix("/v1") + route if route.startswith("/inference") else base + route
    status, answer = client.send("GET" if route == "/models" else "POST", path, body)
    _no_500(status, answer, (route, body))


@EXAMPLES
@given(method=st.sampled_from(["GET", "PUT", "DELETE", "POST"]),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/nothing", "",
                             "/inference/v1/generate", "/v1/embeddings"]),
       episode=st.sampled_from(["{episode}", "no-such-episode", "../x"]))
def test_the_agent_endpoint_answers_wrong_methods_and_routes_with_4xx(agent_server, method: str, path: str,
                                                                      episode: str) -> None:
    client, base, _ = agent_server
    episode_id = base.split("/")[2]
    full = f"/episodes/{episode.format(episode=episode_id)}{path}"
    status, answer = client.send(method, full, b"{}" if method != "GET" else None)
    _no_500(status, answer, (method, full))
    assert status < 300 or 400 <= status < 500


def test_the_agent_endpoint_refuses_out_of_vocabulary_ids_and_keeps_serving(agent_server) -> None:
    """Token ids past the vocabulary on /v1/completions (and bad stop_token_ids on the token route)
    were an engine error, HTTP 500; they are the client's 400, and a good request still works."""
    client, base, vocab = agent_server
    for body in ({"model": "toy", "prompt": [1, vocab + 3]}, {"model": "toy", "prompt": [-1]}):
        status, answer = client.send("POST", base + "/completions", _raw(body))
        assert status == 400 and "outside the vocabulary" in answer.decode(), (body, status, answer)
    generate = base.removesuffix("/v1") + "/inference/v1/generate"
    for stop_ids in (["x"], 5, [[1]]):
        body = {"model": "toy", "token_ids": [1, 2], "sampling_params": {"stop_token_ids": stop_ids}}
        status, answer = client.send("POST", generate, _raw(body))
        assert status == 400 and "stop_token_ids" in answer.decode(), (stop_ids, status, answer)
    status, answer = client.send("POST", base + "/completions", _raw({"model": "toy", "prompt": [1, 2, 3]}))
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == "12"
