"""``rldsl serve-reward``: any reward spec behind HTTP, as a real ASGI server (Starlette on uvicorn).

It answers the reward-server protocol of :mod:`.reward_remote` (OpenRLHF's ``--remote_rm_url``
names included) at ``POST /score`` and at OpenRLHF's path ``POST /get_reward``, and
``GET /health``. A sample whose reward raises gets ``null`` and its error in ``errors``;
the batch still answers. Scoring runs in worker threads, so requests overlap.
"""
from __future__ import annotations

import socket
import threading
from typing import Any

import typer

from ...errors import UsageError
from .functions import RewardFn


def _strings(value: Any, key: str, n: int | None = None) -> list[str]:
    """``value`` as a list of strings (of ``n`` when given), or the ValueError naming ``key``."""
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value) or n not in (None, len(value)):
        raise ValueError(f"'{key}' must be a list of {'' if n is None else f'{n} '}strings")
    return value


def _columns(body: Any) -> tuple[list[str], list[str], list[str], list[str]]:
    """(prompts, completions, answers, finish_reasons) of a request, or a ValueError saying why not
    (every malformed body: answered 400, never a 500)."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    completions = body.get("completions")
    if completions is None and "query" in body:  # an OpenRLHF client: prompt + completion in query
        queries = _strings(body["query"], "query")
        prompts = body.get("prompts")
        prompts = [""] * len(queries) if prompts is None else _strings(prompts, "prompts", len(queries))
        completions = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    if not isinstance(completions, list) or not all(isinstance(c, str) for c in completions):
        raise ValueError("'completions' (or OpenRLHF's 'query') must be a list of strings")
    n = len(completions)
    out = []
    for key, alias, default in (("prompts", None, ""), ("answers", "labels", ""), ("finish_reasons", None, "stop")):
        column = body.get(key, body.get(alias) if alias else None)
        out.append([default] * n if column is None else _strings(column, key, n))
    return out[0], completions, out[1], out[2]


def score_request(reward: RewardFn, body: Any) -> dict[str, list[Any]]:
    """The protocol's answer for one request body: rewards, and errors where a sample failed."""
    prompts, completions, answers, finish_reasons = _columns(body)
    totals = [0.0] * len(completions)
    errors: list[str | None] = [None] * len(completions)
    for term in reward.terms:  # each term scores the whole request (batch terms in one call)
        for i, value in enumerate(reward.term_scores(term, prompts, completions, answers, finish_reasons)):
            if isinstance(value, BaseException):  # the sample gets null; the others are still scored
                errors[i] = errors[i] or f"reward {term.name!r}: {type(value).__name__}: {value}"
            else:
                totals[i] += term.weight * value
    return {"rewards": [None if e else t for t, e in zip(totals, errors)], "errors": errors}


def make_app(spec: str, timeout_s: float = 0.0):
    """The Starlette app serving ``spec`` (a ``--reward`` string: built-ins, module:function, weights);
    ``timeout_s`` > 0: each per-sample call under that limit, in a worker process (a call past it
    is that sample's error, ``null``)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    reward = RewardFn(spec, timeout_s=timeout_s)

    async def score(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep, an int of 5,000 digits
            return JSONResponse({"error": "the body is not JSON (or nested too deep, or a number too long)"},
                                status_code=400)
        try:
            answer = await run_in_threadpool(score_request, reward, body)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        return JSONResponse(answer)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True, "reward": spec})

    return Starlette(routes=[Route("/score", score, methods=["POST"]),
                             Route("/get_reward", score, methods=["POST"]),
                             Route("/health", health, methods=["GET"])])


class BackgroundServer:
    """A uvicorn server on 127.0.0.1 in a thread (tests, notebooks): ``with BackgroundServer(app) as url:``;
    ``options``: more of ``uvicorn.Config``'s (``timeout_keep_alive``, ...)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", **options: Any) -> None:
        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", **options))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        for _ in range(500):  # up to 5 s for the server to listen
            if self.server.started:
                return self.url
            threading.Event().wait(0.01)
        raise RuntimeError("the reward server did not start in 5 s")

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def serve(reward: str, host: str = "127.0.0.1", port: int = 8000, timeout_s: float = 0.0) -> None:
    """``rldsl serve-reward`` (its options: rldsl/runtime/cli.py): serve ``reward`` until Ctrl-C.
    The socket is bound before "serving" is said: a port out of range, one in use or an address
    not of this machine is exit code 2 with the reason (uvicorn would log it and hang)."""
    import uvicorn

    if not 1 <= port <= 65535:
        raise UsageError(f"--port must be in 1..65535, got {port}")
    if not 0 <= timeout_s < float("inf"):
        raise UsageError(f"--timeout-s must be a number of seconds >= 0 (0: no limit), got {timeout_s}")
    app_ = make_app(reward, timeout_s)  # a reward that cannot be loaded: exit code 2
    try:
        sock = socket.create_server((host, port))
    except OSError as e:  # in use, not this machine's address, not permitted
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    typer.echo(f"serving reward {reward!r} at http://{host}:{port}/score (Ctrl-C stops)")
    uvicorn.Server(uvicorn.Config(app_, log_level="warning")).run(sockets=[sock])
