"""``rldsl serve-tinker``: the routes the ``tinker`` client 0.38 calls, as a Starlette app on uvicorn
(the house style of rewards/server.py and rollout/agents/server.py).

Every call that computes answers a request id at once; ``retrieve_future`` answers the result
(protobuf for ``forward_backward`` and ``asample``, JSON for the rest), a ``try_again`` while the
job runs (after holding the poll up to a few seconds), or the job's refusal. A request that
cannot be read or names what is not served is a 4xx with the reason, which the client raises at
once (a 5xx it would retry); the server keeps serving.

The client config we answer (docs/tinker.md): ``parallel_fwdbwd_chunks`` false and chunk limits
no batch reaches, so one ``forward_backward`` call is one request (a spec's mean is then over the
whole call); everything else the client's defaults.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
from pathlib import Path
from typing import Any

from ..errors import TinkerRefused
from . import wire
from .models import check_address
from .service import Service
from .trainer import LoraSpec

log = logging.getLogger("rldsl.tinker")

#: the client flags we set (the rest: the client's defaults)
CLIENT_CONFIG = {"parallel_fwdbwd_chunks": False, "fwdbwd_max_chunk_len": 1 << 30,
                 "fwdbwd_max_chunk_bytes_count": 1 << 40, "fwdbwd_dispatch_bytes_semaphore_size": 1 << 40,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}
POLL_HOLD_S = 5.0
#: how long an idle connection stays open (uvicorn's default: 5 s). The client keeps its idle
#: connections 90 s (its HTTP transport's pool timeout) and holds one per request in flight
#: (~200 a step at math_rl's 100 groups: each ``asample`` and each held ``retrieve_future``):
#: a step longer than 5 s found them all closed and opened them again. Longer than the
#: client's own timeout, so that the client is the side that drops an idle connection.
KEEP_ALIVE_S = 120.0


def make_app(service: Service, api_key: str | None = None) -> Any:
    """The Starlette app over ``service``; ``api_key``: the only key accepted (None: any key)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def refused(e: TinkerRefused) -> JSONResponse:
        return JSONResponse({"error": e.message, "category": "user"}, status_code=e.status)

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise TinkerRefused(400, f"{request.url.path}: the body is not JSON") from None
        if not isinstance(body, dict):
            raise TinkerRefused(400, f"{request.url.path}: the body must be a JSON object")
        return body

    def route(path: str, handler: Any, method: str = "POST") -> Route:
        async def endpoint(request: Request) -> Response:
            if api_key is not None and not secrets.compare_digest(request.headers.get("x-api-key", ""), api_key):
                return JSONResponse({"error": "wrong API key (rldsl serve-tinker --api-key)", "category": "user"},
                                    status_code=401)
            try:
                answer = await handler(request)
            except TinkerRefused as e:
                return refused(e)
            return answer if isinstance(answer, Response) else JSONResponse(answer)
        return Route(path, endpoint, methods=[method])

    def future(request_id: str, model_id: str | None = None, **more: Any) -> dict[str, Any]:
        return {"request_id": request_id, "model_id": model_id, **more}

    async def client_config(request: Request) -> dict[str, Any]:
        return CLIENT_CONFIG

    async def empty(request: Request) -> dict[str, Any]:
        return {}

    async def capabilities(request: Request) -> dict[str, Any]:
        return {"supported_models": [{"model_name": n, "max_context_length": service.contexts[n], "trainable": True,
                                      "sampleable": True} for n in service.models]}

    async def health(request: Request) -> dict[str, Any]:
        return {"status": "ok"}

    async def create_session(request: Request) -> dict[str, Any]:
        await json_body(request)
        return {"session_id": service.new_session(), "type": "create_session"}

    async def heartbeat(request: Request) -> dict[str, Any]:
        await json_body(request)
        return {"type": "session_heartbeat"}

    async def telemetry(request: Request) -> dict[str, Any]:
        return {"status": "accepted"}

    async def create_model(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        cfg = body.get("lora_config") or {}
        try:
            lora = LoraSpec(int(cfg.get("rank", 32)), bool(cfg.get("train_attn", True)), bool(cfg.get("train_mlp", True)),
                            bool(cfg.get("train_unembed", True)), cfg.get("seed"))
        except (TypeError, ValueError):
            raise TinkerRefused(400, f"create_model: bad lora_config {cfg!r}") from None
        if lora.rank < 1:
            raise TinkerRefused(400, f"create_model: LoRA rank must be >= 1, got {lora.rank}")
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise TinkerRefused(400, f"create_model: optimizer {optimizer!r} is not served (adamw is)")
        base = str(body.get("base_model"))
        request_id, model_id = service.create_model(base, lora)
        return future(request_id, model_id)

    async def get_info(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        model_id = str(body.get("model_id"))
        base, lora = service.meta(model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": lora.rank,
                "model_name": base, "model_data": {"arch": "rldsl", "model_name": base, "tokenizer_id": base}}

    async def forward_backward(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if request.headers.get("content-encoding") == "zstd":
            try:
                import zstandard
                raw = zstandard.ZstdDecompressor().decompress(raw)
            except Exception as e:
                raise TinkerRefused(400, f"forward_backward: the zstd body cannot be decompressed ({e})") from None
        parsed = wire.read_forward_backward(raw)
        service.meta(parsed.model_id)
        return future(service.forward_backward(parsed), parsed.model_id)

    async def optim_step(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        model_id = str(body.get("model_id"))
        service.meta(model_id)
        adam = body.get("adam_params")
        if not isinstance(adam, dict):
            raise TinkerRefused(400, "optim_step: only adam_params are served (AdamW)")
        return future(service.optim_step(model_id, int(body.get("seq_id") or 0), adam), model_id)

    async def save_weights(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        model_id = str(body.get("model_id"))
        service.meta(model_id)
        return future(service.save_weights(model_id, int(body.get("seq_id") or 0), body.get("path")), model_id)

    async def save_for_sampler(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        model_id = str(body.get("model_id"))
        service.meta(model_id)
        return future(service.save_for_sampler(model_id, int(body.get("seq_id") or 0), body.get("path")), model_id)

    async def load_weights(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        if body.get("model_id") is not None:
            service.meta(str(body["model_id"]))
        request_id, model_id = service.load_weights(body)
        return future(request_id, model_id)

    async def sampling_session(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        sid = service.sampling_session(body.get("base_model"), body.get("model_path"))
        return {"sampling_session_id": sid, "type": "create_sampling_session"}

    async def get_sampler(request: Request) -> dict[str, Any]:
        sid = request.path_params["sid"]
        s = service.sampler(sid)
        return {"sampler_id": sid, "base_model": s.base, "model_path": s.path}

    async def asample(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        sid = body.get("sampling_session_id")
        if sid is None:
            sid = service.sampling_session(body.get("base_model"), body.get("model_path"))
        request_id, n = service.asample(str(sid), body)
        return future(request_id, None, sample_sequence_ids=[f"{request_id}-{i}" for i in range(n)])

    async def retrieve_future(request: Request) -> Response:
        body = await json_body(request)
        request_id = str(body.get("request_id"))
        fut = service.futures.get(request_id)
        if fut is None:
            raise TinkerRefused(404, f"unknown request_id {request_id!r}")
        await hold_until_done(fut, POLL_HOLD_S)  # hold the poll (no thread held): one round trip per result
        if not fut.done.is_set():
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        service.futures.pop(request_id, None)
        if fut.error is not None:
            return JSONResponse({"error": fut.error, "category": fut.category})
        if fut.proto is not None:
            return Response(fut.proto, media_type="application/x-protobuf")
        return JSONResponse(fut.body)

    async def unknown(request: Request) -> Response:
        return JSONResponse({"error": f"rldsl serve-tinker does not serve {request.method} {request.url.path} "
                                      "(docs/tinker.md lists the routes)", "category": "user"}, status_code=404)

    v1 = "/api/v1"
    routes = [
        route(f"{v1}/client/config", client_config), route(f"{v1}/client/dynamic_config", empty),
        route(f"{v1}/get_server_capabilities", capabilities, "GET"), route(f"{v1}/healthz", health, "GET"),
        route(f"{v1}/create_session", create_session), route(f"{v1}/session_heartbeat", heartbeat),
        route(f"{v1}/sessions/{{sid}}/finish", empty), route(f"{v1}/telemetry", telemetry),
        route(f"{v1}/create_model", create_model), route(f"{v1}/get_info", get_info),
        route(f"{v1}/forward_backward", forward_backward), route(f"{v1}/optim_step", optim_step),
        route(f"{v1}/save_weights", save_weights), route(f"{v1}/save_weights_for_sampler", save_for_sampler),
        route(f"{v1}/load_weights", load_weights), route(f"{v1}/create_sampling_session", sampling_session),
        route(f"{v1}/samplers/{{sid}}", get_sampler, "GET"), route(f"{v1}/asample", asample),
        route(f"{v1}/retrieve_future", retrieve_future),
        Route("/{path:path}", unknown, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ]
    return Starlette(routes=routes)


async def hold_until_done(fut: Any, hold_s: float) -> None:
    """Return once ``fut`` is done (woken by the worker that finishes it) or ``hold_s`` passed."""
    if fut.done.is_set():
        return
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:  # on the worker's thread
        with contextlib.suppress(RuntimeError):  # the server stopped (its loop closed) meanwhile
            loop.call_soon_threadsafe(lambda: ready.done() or ready.set_result(None))
    fut.on_done(wake)
    try:
        await asyncio.wait_for(ready, hold_s)
    except asyncio.TimeoutError:
        pass


def serve(models: dict[str, Path], host: str, port: int, api_key: str | None, root: Path, threads: int = 1,
          engine: str = "hf", vllm_memory: float = 0.1) -> None:
    """``rldsl serve-tinker`` (its options: rldsl/runtime/cli.py): serve until Ctrl-C or SIGTERM."""
    import typer
    import uvicorn
    check_address(host, api_key)
    service = Service(models, root, threads, engine, vllm_memory)
    app = make_app(service, api_key)
    names = ", ".join(f"{n} ({p})" for n, p in models.items())
    typer.echo(f"serving the Tinker API at http://{host}:{port} for {names}, sampling on {engine}; states under "
               f"{root} (Ctrl-C stops)")
    # uvicorn shuts down on SIGTERM, then raises the signal again under the handler found at its
    # start: with this one the command then ends normally (exit 0), the stop being the one asked
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
    finally:
        service.close()
