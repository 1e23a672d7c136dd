"""The OpenAI-compatible HTTP server: FastAPI routes on uvicorn, over AsyncLLM.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (200 while
the engine runs, 503 once it died), GET /version, GET /metrics (Prometheus). Errors use OpenAI's
JSON. With an API key, every route but /health needs `Authorization: Bearer <key>`.
On SIGTERM (or Ctrl-C) uvicorn stops accepting, lets in-flight requests finish for up to
`timeout_graceful_shutdown` seconds, then the engine and its workers stop.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable
from http import HTTPStatus
from importlib.metadata import version

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmctl.engine.async_llm import AsyncLLM
from llmctl.engine.config import EngineArgs
from llmctl.engine.errors import LLMCtlError
from llmctl.engine.server.errors import error_response, response_for
from llmctl.engine.server.metrics import ServerMetrics
from llmctl.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from llmctl.engine.server.serving import ModelNotFound, abort_on_disconnect
from llmctl.engine.server.serving_chat import ChatHandler
from llmctl.engine.server.serving_completions import CompletionsHandler

logger = logging.getLogger("llmctl")


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


def build_app(
    async_llm: AsyncLLM,
    served_model_name: str,
    api_key: str | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="llmctl", version=version("llmctl"), lifespan=lifespan)
    metrics = ServerMetrics(async_llm, served_model_name)
    completions = CompletionsHandler(async_llm, served_model_name, metrics)
    chat = ChatHandler(async_llm, served_model_name, metrics)
    model_config = async_llm.engine.config.model_config
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = loc[0] if loc else None
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(HTTPStatus.BAD_REQUEST, message, param)

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

    @app.get("/health")
    async def health() -> Response:
        if async_llm.dead_error is not None:
            return response_for(async_llm.dead_error)
        return Response(status_code=200)

    @app.get("/version")
    async def get_version() -> dict:
        return {"version": version("llmctl")}

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
                }
            ],
        }

    @app.get("/metrics")
    async def get_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        if body.stream:
            params, prompts = completions.prepare_request(body)
            return StreamingResponse(
                completions.stream(body, params, prompts), media_type="text/event-stream"
            )
        return JSONResponse(await abort_on_disconnect(request, completions.complete(body)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        if body.stream:
            params, prompt = chat.prepare_request(body)
            return StreamingResponse(
                chat.stream(body, params, prompt), media_type="text/event-stream"
            )
        return JSONResponse(await abort_on_disconnect(request, chat.complete(body)))

    return app


def run_server(
    engine_args: EngineArgs,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    timeout_graceful_shutdown: float = 30.0,
    progress=None,
) -> None:
    """Load the model, then serve until SIGTERM or Ctrl-C; the workers stop with the server."""
    import uvicorn

    async_llm = AsyncLLM.from_engine_args(engine_args, progress)
    try:
        name = async_llm.engine.config.model_config.served_model_name

        def listening() -> None:
            logger.info("Serving %s on http://%s:%d (OpenAI API under /v1)", name, host, port)

        app = build_app(async_llm, name, api_key, on_ready=listening)

        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=int(timeout_graceful_shutdown),
        )
        # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again with the
        # handlers it found installed: make those no-ops, so the engine and its workers stop
        # below and the process exits 0.
        previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            uvicorn.Server(config).run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        async_llm.shutdown()


def _ignore(signum, frame) -> None:
    logger.info("%s received: stopped serving", signal.Signals(signum).name)
