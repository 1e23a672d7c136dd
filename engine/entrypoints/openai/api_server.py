"""The OpenAI-compatible HTTP server: FastAPI routes on uvicorn, over an EngineClient.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (200 while
the engine serves, with its restart count; 503 once it died, while it restarts, or while it has
work and no step completed for --stall-timeout seconds; with data-parallel replicas, 200 with a
"degraded" JSON body naming the stopped ones while one serves), GET /version, GET /metrics
(Prometheus). Every error, unknown routes and methods included, is OpenAI's error JSON. With an
API key, every route but /health needs `Authorization: Bearer <key>`.

A request's body is read on the event loop (bounded in size and time), then decoded, validated
and tokenized in a small thread pool, so that a large or slow request never delays /health or
other clients; only then does it reach the engine thread.

On SIGTERM (or Ctrl-C) uvicorn stops accepting, lets in-flight requests finish for up to
`shutdown_timeout` seconds (a second signal cuts them), then the engine and its workers stop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import re
import signal
from collections.abc import Callable
from http import HTTPStatus
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from llmctl.engine import platform
from llmctl.engine.client.factory import build_engine_client
from llmctl.engine.client.protocol import EngineClient
from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.entrypoints.openai.errors import error_response, response_for
from llmctl.engine.entrypoints.openai.http_server import HttpServer, guarded_protocol
from llmctl.engine.entrypoints.openai.metrics import ServerMetrics
from llmctl.engine.entrypoints.openai.request_body import read_body
from llmctl.engine.entrypoints.openai.server_config import ServerConfig, max_token_bytes
from llmctl.engine.entrypoints.openai.serving import (
    ModelNotFound,
    OpenAIServing,
    abort_on_disconnect,
)
from llmctl.engine.entrypoints.openai.serving_chat import ChatHandler
from llmctl.engine.entrypoints.openai.serving_completions import CompletionsHandler
from llmctl.engine.errors import LLMCtlError

logger = logging.getLogger("llmctl")

_ROUTES = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health"


class _ApiKeyMiddleware:
    """Pure ASGI middleware (it leaves streaming and disconnect detection untouched)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if headers.get(b"authorization") != self.expected:
            response = error_response(
                HTTPStatus.UNAUTHORIZED,
                "Incorrect API key provided: send `Authorization: Bearer <key>`",
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def llmctl_version() -> str:
    """The installed llmctl's version; run from a tree never installed (the GPU check on a lent
    machine puts the tree on the import path), pyproject.toml's version with "+source"."""
    try:
        return version("llmctl")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
        found = pyproject.is_file() and re.search(
            r'^version = "([^"]+)"', pyproject.read_text(), re.MULTILINE
        )
        return f"{found.group(1)}+source" if found else "unknown"


def build_app(
    engine_client: EngineClient,
    served_model_name: str,
    server_config: ServerConfig | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    config = server_config or ServerConfig()
    prepare_pool = concurrent.futures.ThreadPoolExecutor(
        config.num_prepare_threads, thread_name_prefix="llmctl-prepare"
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # Set-up's temporaries (the vocabulary scan below, the app's import) leave the heap:
        # the allocator is tuned never to shrink it by itself (platform.tune_cpu_allocator).
        platform.release_free_heap()
        if on_ready is not None:
            on_ready()
        yield
        prepare_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="llmctl", version=llmctl_version(), lifespan=lifespan)
    metrics = ServerMetrics(engine_client, served_model_name)
    if config.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=config.api_key)
    _add_error_handlers(app, served_model_name)
    _add_info_routes(app, engine_client, served_model_name, metrics)
    _add_generation_routes(app, engine_client, served_model_name, metrics, config, prepare_pool)
    return app


def _add_error_handlers(app: FastAPI, served_model_name: str) -> None:
    """Every error in OpenAI's JSON shape, unknown routes and methods included."""

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == HTTPStatus.NOT_FOUND:
            message = f"no route {request.method} {request.url.path}; this server has {_ROUTES}"
        elif exc.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
            allowed = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow", "")
            message = f"{request.method} is not allowed on {request.url.path}; use {allowed}"
        else:
            message = str(exc.detail)
        return error_response(HTTPStatus(exc.status_code), message, headers=exc.headers)

    @app.exception_handler(ModelNotFound)
    async def _no_model(request: Request, exc: ModelNotFound) -> JSONResponse:
        return error_response(
            HTTPStatus.NOT_FOUND,
            f"The model `{exc.name}` does not exist; this server serves `{served_model_name}`",
            "model",
        )

    @app.exception_handler(LLMCtlError)
    async def _llmctl_error(request: Request, exc: LLMCtlError) -> JSONResponse:
        return response_for(exc)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody reads it; nothing to log

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        return response_for(exc)  # 500 in OpenAI's shape (uvicorn logs the traceback)


def _add_info_routes(
    app: FastAPI, engine_client: EngineClient, served_model_name: str, metrics: ServerMetrics
) -> None:
    """/health, /version, /v1/models, /metrics."""
    model_config = engine_client.engine.config.model_config

    @app.get("/health")
    async def health() -> Response:
        error = engine_client.health_error()
        if error is not None:
            return response_for(error)
        states = engine_client.replica_states()
        dead = [(replica, e) for replica, _, e in states if e is not None]
        if dead:  # data parallel: some replicas stopped, the others serve
            return JSONResponse(
                {
                    "status": "degraded",
                    "message": f"{len(dead)} of {len(states)} data-parallel replicas stopped: "
                    + "; ".join(f"replica {r}: {e.message}" for r, e in dead),
                    "replicas": [
                        {"replica": r, "alive": e is None}
                        | ({} if e is None else {"reason": e.message})
                        for r, _, e in states
                    ],
                }
            )
        return JSONResponse(engine_client.health())

    @app.get("/version")
    async def get_version() -> dict:
        return {"version": llmctl_version()}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "llmctl",
                    "root": model_config.path,
                    "max_model_len": model_config.max_model_len,
                    "vocab_size": model_config.shape.vocab_size,  # (llmctl's: bench serve)
                }
            ],
        }

    @app.get("/metrics")
    async def get_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_generation_routes(
    app: FastAPI,
    engine_client: EngineClient,
    served_model_name: str,
    metrics: ServerMetrics,
    config: ServerConfig,
    prepare_pool: concurrent.futures.Executor,
) -> None:
    """/v1/completions and /v1/chat/completions: a body read on the event loop (bounded in size
    and time), prepared in the pool, then streamed or answered whole."""
    completions = CompletionsHandler(engine_client, served_model_name, metrics)
    chat = ChatHandler(engine_client, served_model_name, metrics)
    body_limit = config.body_limit(
        engine_client.engine.config.model_config.max_model_len,
        max_token_bytes(engine_client.engine.tokenizer),
    )

    async def serve(request: Request, handler: OpenAIServing) -> Response:
        length = request.headers.get("content-length")
        raw = await read_body(
            request.receive,
            int(length) if length and length.isdigit() else None,
            body_limit,
            config.http_timeout,
        )
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(prepare_pool, handler.prepare, raw)
        if prepared.body.stream:
            return StreamingResponse(handler.stream(prepared), media_type="text/event-stream")
        return JSONResponse(await abort_on_disconnect(request, handler.complete(prepared)))

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await serve(request, completions)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await serve(request, chat)


def run_server(
    engine_args: EngineArgs, server_config: ServerConfig | None = None, progress=None
) -> None:
    """Load the model, then serve until SIGTERM or Ctrl-C; the workers stop with the server."""
    import uvicorn

    config = server_config or ServerConfig()
    if (warning := config.api_key_warning()) is not None:
        logger.warning("%s", warning)
    engine_client = build_engine_client(engine_args, progress)
    try:
        name = engine_client.engine.config.model_config.served_model_name

        def listening() -> None:
            logger.info(
                "Serving %s on http://%s:%d (OpenAI API under /v1)", name, config.host, config.port
            )

        app = build_app(engine_client, name, config, on_ready=listening)
        uvicorn_config = uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            http=guarded_protocol(config.http_timeout),
            # asyncio's loop, not uvloop even where it is installed (Ray Serve's extra brings
            # it): the server behaves the same with or without Ray.
            loop="asyncio",
            log_level="warning",
            timeout_graceful_shutdown=int(config.shutdown_timeout),
        )
        # uvicorn shuts down on SIGTERM/SIGINT, then raises the signals again with the handlers
        # it found installed: make those no-ops, so the engine and its workers stop below and
        # the process exits 0.
        previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            HttpServer(uvicorn_config).run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        engine_client.shutdown()


def _ignore(signum, frame) -> None:
    pass
