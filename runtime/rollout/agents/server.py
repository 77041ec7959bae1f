"""The policy behind an OpenAI-compatible endpoint on 127.0.0.1, for the length of a batch.

Each episode gets a base URL of its own, ``http://127.0.0.1:PORT/episodes/<id>/v1``: that path
is how calls are grouped into episodes. Routes under it:

    GET  /v1/models               the one served model (``max_model_len``: the model's context)
    POST /v1/chat/completions     messages (+ tools) rendered with the chat template
    POST /v1/completions          a prompt as text (tokenised as is) or as token ids
    POST /inference/v1/generate   token ids in, token ids + one logprob per token out (the route
                                  verifiers' training client and prime-rl's renderers call)

Every answered choice is recorded (records.Call) with the exact prompt ids the engine saw, the
sampled ids, their logprobs and the policy version. A chat call whose messages repeat an earlier
call of the episode plus the assistant message it returned is *bridged*: its prompt is that
call's prompt ids + its sampled ids + the chat template's rendering of the new messages (the
built-in episodes' delta, episodes/runner.py env_delta) -- the model's tokens are never
re-tokenised. Any other call is rendered whole.

Images (a vision-language policy, docs/vlm.md): a chat message's content may hold ``image_url``
parts whose URL is a ``data:image/...;base64,`` URL, as OpenAI's chat API takes them; an http(s)
URL is refused (400: the endpoint fetches nothing). Each image becomes its expanded image tokens
in the prompt ids, and the call records the images its prompt ids hold (``Call.images``, in
order; a bridged call's are the earlier call's then the new messages'). Token and text routes
take no images (prompt ids holding image tokens are refused).

Sampling follows the run, not the request: ``temperature`` and ``top_p`` are the run's (the
trainer recomputes logprobs at the run's temperature); ``max_tokens`` is clamped to the run's
``max_new_tokens`` and to the room left in the model's context; ``stop`` strings and
``stop_token_ids`` end a completion after the token that completes them; ``n`` up to
:data:`MAX_N`; ``logprobs`` returns the sampled token's logprob (``top_logprobs`` lists are
empty). Requests are batched: whatever is waiting when the engine is free goes in one
``generate_ids`` call (one call per distinct (max_tokens, n)).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import queue
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ...batch import sequence_routing
from ...data.images import chat_content
from ...models.kinds import ModelKind, text_kind
from ..engines.base import SamplingParams
from ..episodes.parsers import ToolCall, parse_tool_calls, text_for_tools
from ..episodes.runner import env_delta
from ...errors import RequestRefused
from . import vllm_tools
from .calls import Call

#: Most choices one request may ask for (``n``).
MAX_N = 16


@dataclass
class _Turn:
    """A chat call the next call of its episode may continue (bridge): what it was asked, what
    it answered, its ids."""

    keys: list[tuple]          # the request's messages, normalised (_key)
    messages: list[dict]       # the request's messages as the template renders them
    tools_key: str
    reply_key: tuple           # the assistant message it returned, normalised
    raw_text: str              # the sampled ids decoded (what the template puts in the turn)
    stopped: bool              # the sampled ids end with the tokenizer's EOS
    ids: list[int]             # prompt ids + sampled ids
    images: list[str] = field(default_factory=list)  # the images those ids hold, in order


@dataclass
class EpisodeLog:
    """One episode's state on the server: its calls, limits and bridgeable turns."""

    id: str
    deadline: float                      # time.monotonic() past which calls are refused
    calls: list[Call] = field(default_factory=list)
    turns: list[_Turn] = field(default_factory=list)
    accepted: int = 0                    # requests accepted (for max_calls)
    in_flight: int = 0
    open: bool = True
    closed_because: str = ""
    refused: list[str] = field(default_factory=list)  # why requests were refused (for the record)


@dataclass
class _Job:
    prompt_ids: list[int]
    max_tokens: int
    n: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    images: list[str] = field(default_factory=list)  # the images the prompt ids hold (data: URLs)


def _cut(routed: Any, n: int) -> Any:
    """A choice's recorded experts [len(prompt) + len(ids), Y, K] for its first ``n`` tokens (the
    ids a request's stop cut after), or None."""
    return None if routed is None else routed[:n]


class PolicyServer:
    """The endpoint (a uvicorn server in a thread of its own) and the engine loop behind it.

    ``use(engine, params, version)`` binds the engine, the run's sampling parameters and the
    policy version for the batch in hand; ``open_episode`` / ``close_episode`` bracket each
    episode. ``max_calls``: requests an episode may make; ``max_parallel``: its requests in
    flight at once (more are answered 429); ``keep_alive_s``: how long an idle connection is kept
    open, longer than any episode lasts (:meth:`start`)."""

    def __init__(self, tokenizer: Any, *, model_name: str, context: int | None, max_calls: int,
                 max_parallel: int, tool_parser: str = "hermes", chat_template_kwargs: dict | None = None,
                 keep_alive_s: float = 3600.0, kind: ModelKind | None = None) -> None:
        self.tokenizer = tokenizer
        # the policy's kind (models/kinds/, the engine's; None: a text model's): how chat calls'
        # images become tokens (a text model refuses them)
        self.kind = kind if kind is not None else text_kind(tokenizer)
        self.keep_alive_s = keep_alive_s
        self.model_name = model_name
        self.context = context
        self.max_calls = max_calls
        self.max_parallel = max_parallel
        self.tool_parser = tool_parser
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.episodes: dict[str, EpisodeLog] = {}
        self._lock = threading.Lock()
        self._engine: Any = None
        self._params: SamplingParams | None = None
        self._version = 0
        self._tool_reader: Any = None  # vLLM's own tool parser, when the engine is vLLM (vllm_tools.py)
        self._seeds = itertools.count()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._engine_loop, name="agent endpoint engine", daemon=True)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.base_url = ""

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> str:
        """Start serving on 127.0.0.1 (a free port); returns the server's root URL."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)  # connections wait in the backlog until the server accepts them
        port = sock.getsockname()[1]
        # Idle connections stay open for longer than an episode lasts (keep_alive_s; uvicorn's
        # default closes them after 5 s idle). Every client is the run's own, one per episode and
        # closed when its episode ends, so the server has no idle connection of a live episode to
        # reap -- and closing one races the client's next request on it: a request sent as the
        # server hangs up (on a loaded machine the server's loop is late, and the window wide) is
        # reset unanswered, httpx's ReadError (ECONNRESET / EPIPE), which the openai client
        # (max_retries=0) raises as APIConnectionError "Connection error." and the episode ends.
        # Client retries are no fix: the endpoint records every call it answers, and a client
        # cannot tell a request the server never read from one it answered and recorded before
        # the connection broke; a retry of the latter would sample and record the call twice.
        config = uvicorn.Config(self.app(), log_level="error", lifespan="off", access_log=False,
                                timeout_keep_alive=self.keep_alive_s)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="agent endpoint", daemon=True)
        self._thread.start()
        self._worker.start()
        self.base_url = f"http://127.0.0.1:{port}"
        return self.base_url

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def use(self, engine: Any, params: SamplingParams, version: int) -> None:
        """The engine, the run's sampling parameters and the policy version of the next episodes."""
        if self._tool_reader is None and vllm_tools.is_vllm_engine(engine):
            self._tool_reader = vllm_tools.vllm_tool_reader(self.tool_parser, self.tokenizer)
        self._engine, self._params, self._version = engine, params, version
        # each batch's engine calls count from 0: a resumed run's seeds are its twin's
        self._seeds = itertools.count()

    def episode_url(self, episode_id: str) -> str:
        """The OpenAI base URL of an episode (ends with /v1)."""
        return f"{self.base_url}/episodes/{episode_id}/v1"

    def open_episode(self, time_limit_s: float) -> EpisodeLog:
        log = EpisodeLog(uuid.uuid4().hex[:12], time.monotonic() + time_limit_s)
        with self._lock:
            self.episodes[log.id] = log
        return log

    def close_episode(self, log: EpisodeLog, because: str) -> None:
        """No more calls for this episode (answered 410); calls in flight are not recorded."""
        with self._lock:
            if log.open:
                log.open, log.closed_because = False, because
            self.episodes.pop(log.id, None)

    # ---------------------------------------------------------------- the app
    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        def handler(fn: Callable, needs_body: bool = True) -> Callable:
            async def endpoint(request: Any) -> Any:
                try:
                    log = self._episode(request.path_params["episode"])
                    body: dict = {}
                    if needs_body:
                        try:
                            body = await request.json()
                        except (ValueError, RecursionError):  # not JSON or UTF-8, too deep, too long a number
                            raise RequestRefused(400, "the request body is not JSON (or is nested too deep, "
                                                      "or holds a number too long)") from None
                        if not isinstance(body, dict):
                            raise RequestRefused(400, "the request body must be a JSON object")
                    out = await fn(log, body)
                except RequestRefused as e:
                    return JSONResponse(e.body(), status_code=e.status)
                if isinstance(out, list):  # a chat stream: its chunks
                    return StreamingResponse(_sse(out), media_type="text/event-stream")
                return JSONResponse(out)
            return endpoint

        async def not_found(request: Any, exc: Exception) -> Any:
            return JSONResponse(RequestRefused(
                404, f"no route {request.url.path!r}: each episode's base URL is "
                     f"{self.base_url}/episodes/<episode id>/v1 (the client the agent is given is "
                     "bound to it)", code="not_found").body(), status_code=404)

        prefix = "/episodes/{episode}"
        routes = [Route(prefix + "/v1/models", handler(self._models, needs_body=False), methods=["GET"]),
                  Route(prefix + "/v1/chat/completions", handler(self._chat), methods=["POST"]),
                  Route(prefix + "/v1/completions", handler(self._completions), methods=["POST"]),
                  Route(prefix + "/inference/v1/generate", handler(self._generate), methods=["POST"])]
        return Starlette(routes=routes, exception_handlers={404: not_found})

    def _episode(self, episode_id: str) -> EpisodeLog:
        with self._lock:
            log = self.episodes.get(episode_id)
        if log is None or not log.open:
            why = f" ({log.closed_because})" if log is not None else ""
            raise RequestRefused(410, f"episode {episode_id!r} is over or unknown{why}: each episode's "
                                    "client works only while its agent runs", code="episode_closed")
        if time.monotonic() > log.deadline:
            raise RequestRefused(410, f"episode {episode_id!r} is past its time limit "
                                    "(rollout.agent_timeout_s)", code="episode_closed")
        return log

    async def _models(self, log: EpisodeLog, body: dict) -> dict:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rldsl"}
        if self.context is not None:
            card["max_model_len"] = self.context
        return {"object": "list", "data": [card]}

    # ---------------------------------------------------------------- checks
    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model != self.model_name:
            raise RequestRefused(404, f"model {model!r} is not served here: this endpoint serves "
                                    f"{self.model_name!r} (GET /v1/models)", code="model_not_found",
                               param="model")

    def _max_tokens(self, body: dict, prompt_len: int, *names: str) -> int:
        assert self._params is not None
        asked = next((body[k] for k in names if body.get(k) is not None), None)
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
            raise RequestRefused(400, f"{names[0]} must be a positive integer, got {asked!r}", param=names[0])
        room = None if self.context is None else self.context - prompt_len
        if room is not None and room < 1:
            raise RequestRefused(400, f"the prompt is {prompt_len} tokens: it leaves no room in the model's "
                                    f"context of {self.context} tokens", code="context_length_exceeded")
        limit = self._params.max_new_tokens if room is None else min(self._params.max_new_tokens, room)
        return limit if asked is None else min(asked, limit)  # clamped to the run's limits

    def _n(self, body: dict) -> int:
        n = body.get("n", 1) or 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise RequestRefused(400, f"n must be an integer in 1..{MAX_N}, got {n!r}", param="n")
        return n

    def _stops(self, body: dict) -> list[str]:
        stop = body.get("stop")
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            raise RequestRefused(400, "stop must be a non-empty string or a list of at most 4", param="stop")
        return stops

    # ---------------------------------------------------------------- sampling
    async def _sample(self, log: EpisodeLog, prompt_ids: list[int], max_tokens: int,
                      n: int, images: list[str] | None = None) -> list[tuple[list[int], list[float], bool, Any]]:
        """``n`` choices for one prompt: (sampled ids, logprobs, stopped by a stop token, the
        recorded experts of the prompt and sampled ids [len(prompt) + len(ids), Y, K] or None)."""
        with self._lock:
            if log.accepted >= self.max_calls:
                log.refused.append("call limit")
                raise RequestRefused(429, f"episode {log.id!r} made its {self.max_calls} calls "
                                        "(rollout.max_turns)", code="call_limit")
            if log.in_flight >= self.max_parallel:
                log.refused.append("parallel limit")
                raise RequestRefused(429, f"episode {log.id!r} has {log.in_flight} calls in flight: at most "
                                        f"{self.max_parallel} at once (rollout.agent_max_parallel_calls)",
                                   code="too_many_parallel_calls")
            log.accepted += 1
            log.in_flight += 1
        try:
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            self._jobs.put(_Job(list(prompt_ids), max_tokens, n, loop, future, list(images or [])))
            return await future
        finally:
            with self._lock:
                log.in_flight -= 1

    def _engine_loop(self) -> None:
        """Take every waiting request, sample them in one generate_ids call per (max_tokens, n)."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            jobs = [job]
            while True:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._jobs.put(None)
                    break
                jobs.append(more)
            groups: dict[tuple[int, int], list[_Job]] = {}
            for j in jobs:
                groups.setdefault((j.max_tokens, j.n), []).append(j)
            for (max_tokens, n), group in groups.items():
                try:
                    results = self._run_engine([j.prompt_ids for j in group], max_tokens, n,
                                               [j.images for j in group])
                except BaseException as e:  # noqa: BLE001 - every waiting request gets the error
                    for j in group:
                        j.loop.call_soon_threadsafe(_settle, j.future, None, e)
                    continue
                for k, j in enumerate(group):
                    j.loop.call_soon_threadsafe(_settle, j.future, results[k * n:(k + 1) * n], None)

    def _run_engine(self, prompt_ids: list[list[int]], max_tokens: int, n: int,
                    images: list[list[str]] | None = None) -> list[tuple[list[int], list[float], bool, Any]]:
        assert self._params is not None and self._engine is not None, "use(engine, params, version) first"
        base = self._params
        seed = None if base.seed is None else (base.seed * 1_000_003 + next(self._seeds)) % 2**63
        params = replace(base, n=n, max_new_tokens=max_tokens, seed=seed,
                         min_new_tokens=min(base.min_new_tokens, max_tokens))
        # each prompt carries its images (the engine reads their pixels; decoded only then); None: the
        # engine decodes the ids
        prompts = self.kind.image_prompts((self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompt_ids),
                                          images or [[] for _ in prompt_ids])
        out = self._engine.generate_ids(prompt_ids, params, prompts=prompts)
        results = []
        for r in range(len(prompt_ids) * n):
            m = out.response_mask[r].bool()
            ids = out.response_ids[r][m].tolist()
            results.append((ids, out.logprobs[r][m].tolist(), out.finish_reason[r] == "stop",
                            sequence_routing(out, r, len(prompt_ids[r // n]), len(ids))))
        return results

    def _finish(self, ids: list[int], lps: list[float], stopped: bool, stops: list[str],
                stop_ids: set[int], tools: bool = False) -> tuple[list[int], list[float], str, str]:
        """(ids, logprobs) cut after the first request stop (a ``stop`` string or a
        ``stop_token_ids`` id), the text returned (without the stop string) and the finish reason.
        ``tools``: the text keeps its special tokens but the stop token (parsers.text_for_tools:
        a tool parser's markers may be special tokens), as vLLM's server decodes a request with tools."""
        for t, i in enumerate(ids):
            if i in stop_ids:
                ids, lps, stopped = ids[:t + 1], lps[:t + 1], True
                break

        def decode(part: list[int], last: bool) -> str:
            if tools:
                return text_for_tools(self.tokenizer, part, stopped and last)
            return self.tokenizer.decode(part, skip_special_tokens=True)

        text = decode(ids, True)
        if stops and any(s in text for s in stops):
            for t in range(1, len(ids) + 1):  # the first token whose text completes a stop string
                part = decode(ids[:t], t == len(ids))
                hits = [part.find(s) for s in stops if s in part]
                if hits:
                    return ids[:t], lps[:t], part[:min(hits)], "stop"
        return ids, lps, text, "stop" if stopped else "length"

    def _record(self, log: EpisodeLog, call: Call) -> bool:
        with self._lock:
            if not log.open:
                return False  # the episode ended while this call sampled: nobody saw it
            log.calls.append(call)
            return True

    # ---------------------------------------------------------------- routes
    async def _generate(self, log: EpisodeLog, body: dict) -> dict:
        """``{"model", "token_ids", "sampling_params": {...}}`` -> ``{"choices": [{"token_ids",
        "logprobs": {"content": [{"token": "token_id:<id>", "logprob"}]}, "finish_reason"}],
        "prompt_token_ids"}``."""
        self._check_model(body)
        prompt = body.get("token_ids")
        if not _is_ids(prompt) or not prompt:
            raise RequestRefused(400, "token_ids must be a non-empty list of token ids", param="token_ids")
        self._in_vocabulary(prompt, "token_ids")
        self._no_image_tokens(prompt, "token_ids")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise RequestRefused(400, "sampling_params must be an object", param="sampling_params")
        max_tokens = self._max_tokens(sp, len(prompt), "max_tokens")
        meta = _metadata(body)
        n = self._n(sp)
        stops = self._stops(sp)
        stop_ids = sp.get("stop_token_ids") or []
        if not _is_ids(stop_ids):
            raise RequestRefused(400, "stop_token_ids must be a list of token ids", param="stop_token_ids")
        stop_ids = set(stop_ids)
        choices = []
        for k, (ids, lps, stopped, routed) in enumerate(await self._sample(log, prompt, max_tokens, n)):
            ids, lps, text, finish = self._finish(ids, lps, stopped, stops, stop_ids)
            if not self._record(log, Call(list(prompt), ids, lps, self._version, finish, "generate", text,
                                          metadata=meta, routed_experts=_cut(routed, len(prompt) + len(ids)))):
                continue
            choices.append({"index": k, "token_ids": ids, "text": text, "finish_reason": finish,
                            "logprobs": {"content": [{"token": f"token_id:{i}", "logprob": lp}
                                                     for i, lp in zip(ids, lps)]}})
        return {"request_id": f"gen-{uuid.uuid4().hex[:16]}", "prompt_token_ids": list(prompt),
                "choices": choices}

    async def _completions(self, log: EpisodeLog, body: dict) -> dict:
        self._check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif _is_ids(prompt) and prompt:
            ids = list(prompt)
            self._in_vocabulary(ids, "prompt")
        else:
            raise RequestRefused(400, "prompt must be one string or one list of token ids (one prompt "
                                    "per request)", param="prompt")
        if not ids:
            raise RequestRefused(400, "the prompt is empty", param="prompt")
        self._no_image_tokens(ids, "prompt")
        if body.get("stream"):
            raise RequestRefused(400, "stream is not supported on /v1/completions", param="stream")
        max_tokens = self._max_tokens(body, len(ids), "max_tokens")
        meta = _metadata(body)
        n = self._n(body)
        stops = self._stops(body)
        want_lp = body.get("logprobs") is not None
        choices = []
        completion_tokens = 0
        for k, (out, lps, stopped, routed) in enumerate(await self._sample(log, ids, max_tokens, n)):
            out, lps, text, finish = self._finish(out, lps, stopped, stops, set())
            if not self._record(log, Call(list(ids), out, lps, self._version, finish, "completions", text,
                                          metadata=meta, routed_experts=_cut(routed, len(ids) + len(out)))):
                continue
            completion_tokens += len(out)
            choice = {"index": k, "text": text, "finish_reason": finish, "logprobs": None}
            if want_lp:
                toks = self.tokenizer.convert_ids_to_tokens(out)
                choice["logprobs"] = {"tokens": toks, "token_logprobs": lps, "top_logprobs": None,
                                      "text_offset": None}
            choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(ids) + completion_tokens}}

    async def _chat(self, log: EpisodeLog, body: dict) -> dict | list:
        self._check_model(body)
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                           for m in raw):
            raise RequestRefused(400, "messages must be a non-empty list of {'role': ..., 'content': ...}",
                               param="messages")
        tools = body.get("tools") or None
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise RequestRefused(400, "tools must be a list of {'type': 'function', 'function': {...}}",
                               param="tools")
        messages = [_template_message(m, self.kind) for m in raw]
        keys = [_key(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True)
        prompt, bridged, images = self._bridge(log, messages, keys, tools, tools_key)
        if prompt is None:
            try:
                text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                          add_generation_prompt=True, **self.template_kwargs)
            except Exception as e:  # a template that cannot render these messages
                raise RequestRefused(400, f"the chat template cannot render these messages: "
                                        f"{type(e).__name__}: {e}", param="messages") from None
            images = self.kind.message_images(messages)
            prompt = self._ids(text, images)
        max_tokens = self._max_tokens(body, len(prompt), "max_completion_tokens", "max_tokens")
        meta = _metadata(body)
        n = self._n(body)
        stops = self._stops(body)
        want_lp = bool(body.get("logprobs"))
        choices = []
        completion_tokens = 0
        with_tools = bool(tools) and body.get("tool_choice") != "none"
        for k, (ids, lps, stopped, routed) in enumerate(await self._sample(log, prompt, max_tokens, n, images)):
            ids, lps, text, finish = self._finish(ids, lps, stopped, stops, set(), with_tools)
            message = self._reply(text, tools, body)
            if message.get("tool_calls") and finish == "stop":
                finish = "tool_calls"
            reply = _template_message(message)
            reply_key = _key(reply)
            call = Call(list(prompt), ids, lps, self._version, finish, "chat", text,
                        messages=messages + [reply], bridged=bridged, metadata=meta, images=list(images),
                        routed_experts=_cut(routed, len(prompt) + len(ids)))
            if not self._record(log, call):
                continue
            raw_text = self.tokenizer.decode(ids, skip_special_tokens=True)
            with self._lock:
                # the template's own end of turn follows unless the model sampled the EOS itself
                log.turns.append(_Turn(keys, messages, tools_key, reply_key, raw_text,
                                       bool(ids) and ids[-1] == self.tokenizer.eos_token_id, list(prompt) + ids,
                                       list(images)))
            completion_tokens += len(ids)
            choice: dict = {"index": k, "message": message, "finish_reason": finish, "logprobs": None}
            if want_lp:
                toks = self.tokenizer.convert_ids_to_tokens(ids)
                choice["logprobs"] = {"content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                    for t, lp in zip(toks, lps)]}
            choices.append(choice)
        response = {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion",
                    "created": int(time.time()), "model": self.model_name, "choices": choices,
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                              "total_tokens": len(prompt) + completion_tokens}}
        if body.get("stream"):
            return _chunks(response)
        return response

    def _reply(self, text: str, tools: list | None, body: dict) -> dict:
        """The assistant message of a completion: with ``tools``, its well-formed calls (read by
        the run's tool parser: vLLM's own of that name when the engine is vLLM) as ``tool_calls``
        and the text around them as ``content``."""
        if tools and self._tool_reader is not None:
            read = self._tool_reader(text, body)
            if read is not None:
                content, calls = read
                return {"role": "assistant", "content": (content or "").strip() or None, "tool_calls": calls}
            return {"role": "assistant", "content": text}
        if tools:
            calls = parse_tool_calls(self.tool_parser, text)
            if calls and all(isinstance(c, ToolCall) for c in calls):
                content = _strip_calls(text).strip()
                return {"role": "assistant", "content": content or None, "tool_calls": [
                    {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                     "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]}
        return {"role": "assistant", "content": text}

    def _ids(self, text: str, images: list[str]) -> list[int]:
        """The token ids of a rendered chat (or a delta): its images' placeholders expanded."""
        try:
            return self.kind.prompt_ids(text, images)
        except ValueError as e:  # an image part the template did not render as an image
            raise RequestRefused(400, f"the messages' images do not match the chat template's image "
                                    f"placeholders: {e}", param="messages") from None

    def _in_vocabulary(self, ids: list[int], param: str) -> None:
        """Token ids a client sent are the tokenizer's (an id outside it would fail in the engine:
        an HTTP 500 for the client's mistake)."""
        vocab = len(self.tokenizer)
        if any(not 0 <= i < vocab for i in ids):
            raise RequestRefused(400, f"{param} holds ids outside the vocabulary (0..{vocab - 1})", param=param)

    def _no_image_tokens(self, ids: list[int], param: str) -> None:
        """Token and text prompts carry no images: ids holding image tokens are refused."""
        try:
            self.kind.check_plain_ids(ids)
        except ValueError as e:
            raise RequestRefused(400, f"{e}, but only chat calls take images: send them as image_url parts to "
                                      "/v1/chat/completions", param=param) from None

    def _bridge(self, log: EpisodeLog, messages: list[dict], keys: list[tuple], tools: list | None,
                tools_key: str) -> tuple[list[int] | None, bool, list[str]]:
        """The prompt ids of a chat call that continues an earlier call of the episode (its messages,
        then the reply it got, then new messages): that call's ids + the template's delta, and the
        images those ids hold (the earlier call's, then the new messages'); None when no earlier
        call fits or the template cannot be extended."""
        with self._lock:
            turns = list(log.turns)
        for turn in reversed(turns):
            n = len(turn.keys)
            if len(keys) <= n or turn.tools_key != tools_key or keys[:n] != turn.keys \
                    or keys[n] != turn.reply_key:
                continue
            tail = messages[n + 1:]
            if any(m["role"] == "assistant" for m in tail):
                continue
            history = turn.messages + [{"role": "assistant", "content": turn.raw_text}]
            try:
                delta = env_delta(self.tokenizer, history, tail, tools, turn.stopped, self.template_kwargs)
            except Exception:  # the template renders the history differently: render it whole
                continue
            new = self.kind.message_images(tail)
            return turn.ids + self._ids(delta, new), True, turn.images + new
        return None, False, []


def _is_ids(value: Any) -> bool:
    """A list of ints (not bools): what token ids a request sends are."""
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(RequestRefused(500, f"the engine failed: {type(error).__name__}: {error}",
                                          code="engine_error"))
    else:
        future.set_result(result)


def _strip_calls(text: str) -> str:
    return re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones, joined
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def _metadata(body: dict) -> dict[str, str]:
    """A request's ``metadata`` (OpenAI's field: at most 16 string keys of at most 64 characters,
    string values of at most 512): recorded with each of its calls, where ``group_by=FIELD`` reads a
    row's field (e.g. ``metadata={"role": "solver"}``: docs/agents.md). Anything else is refused."""
    meta = body.get("metadata")
    if meta is None:
        return {}
    if not isinstance(meta, dict) or len(meta) > 16 or not all(
            isinstance(k, str) and 0 < len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in meta.items()):
        raise RequestRefused(400, "metadata must be an object of at most 16 string keys (1..64 characters) with "
                                  "string values (at most 512 characters)", param="metadata")
    return dict(meta)


def _template_message(m: dict, kind: ModelKind | None = None) -> dict:
    """A request message as the chat template takes it: string content (a list of text and
    ``{"type": "image", "image": URL}`` parts when it has ``image_url`` parts), tool calls with
    their arguments as objects."""
    try:  # image_url parts are the kind's to read (a text model refuses them)
        content = chat_content(m.get("content"), (kind or text_kind()).image_part, _content_text)
    except ValueError as e:
        raise RequestRefused(400, str(e), param="messages") from None
    out: dict = {"role": m["role"], "content": content}
    calls = []
    for tc in m.get("tool_calls") or []:
        f = tc.get("function", tc) if isinstance(tc, dict) else {}
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append({"type": "function", "function": {"name": f.get("name"), "arguments": args}})
    if calls:
        out["tool_calls"] = calls
    for k in ("name", "tool_call_id"):
        if isinstance(m.get(k), str):
            out[k] = m[k]
    return out


def _key(m: dict) -> tuple:
    """What makes two messages the same for bridging: role, text, tool calls (name, arguments)."""
    calls = tuple((tc["function"]["name"], json.dumps(tc["function"]["arguments"], sort_keys=True))
                  for tc in m.get("tool_calls", []))
    content = m.get("content") or ""
    if isinstance(content, list):  # text and image parts: the texts and the images' URLs
        content = tuple((p["type"], p.get("text") or p.get("image")) for p in content)
    return m["role"], content, calls


def _chunks(response: dict) -> list[dict]:
    """A chat completion as stream chunks: per choice its whole message in one delta, then its
    finish reason."""
    head = {k: response[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks = []
    for c in response["choices"]:
        delta = {"role": "assistant", "content": c["message"].get("content")}
        if c["message"].get("tool_calls"):
            delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(c["message"]["tool_calls"])]
        chunks.append(head | {"choices": [{"index": c["index"], "delta": delta, "finish_reason": None,
                                           "logprobs": c["logprobs"]}]})
        chunks.append(head | {"choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]})
    chunks.append(head | {"choices": [], "usage": response["usage"]})
    return chunks


async def _sse(chunks: list[dict]):
    for c in chunks:
        yield f"data: {json.dumps(c)}\n\n"
    yield "data: [DONE]\n\n"
