"""The FastAPI app: OpenAI routes, corpus routes, /health, /metrics, errors and middleware.

    state = build_state(EngineConfig(...), ServerSettings(...))   # slow: loads the model
    app = create_app(state)                                        # serve with uvicorn
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ngramspec.server import (
    admin_routes,
    completions,
    corpus_routes,
    learned,
    openapi,
    tokenize_routes,
)
from ngramspec.server.protocol import ApiError
from ngramspec.server.security import ApiKeyMiddleware, BodyLimitMiddleware
from ngramspec.server.state import ServerState

log = logging.getLogger("ngramspec.server")
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
          "/v1/corpora", "/v1/learned", "/v1/learned/save", "/v1/learned/restore",
          "/v1/learned/flush", "/update_weights_from_disk", "/flush_cache", "/tokenize",
          "/detokenize", "/docs", "/redoc", "/openapi.json")


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ngramspec", version=_version(), lifespan=_lifespan(state),
                  description="OpenAI-compatible server with lossless n-gram speculative "
                  "decoding (vLLM's extra routes and fields too).")
    app.state.server = state
    app.include_router(completions.router)
    app.include_router(tokenize_routes.router)
    app.include_router(corpus_routes.router)
    app.include_router(admin_routes.router)
    _add_basic_routes(app)
    _add_error_handlers(app)
    openapi.install(app)
    # Added last = outermost: count every request, answer CORS preflights without a key (a
    # browser never sends one with them), check the key before buffering a body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.settings.max_body_bytes)
    if state.settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=state.settings.api_key)
    if state.settings.allowed_origins:
        # vLLM's defaults for --allowed-methods / --allowed-headers: all of them.
        app.add_middleware(CORSMiddleware, allow_origins=state.settings.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(RequestCounter, state=state)
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ngramspec")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0.0.0"


def _lifespan(state: ServerState) -> Any:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            await shutdown(state)

    return lifespan


async def shutdown(state: ServerState) -> None:
    """Stop admitting, let in-flight requests finish (bounded), save the learned corpus."""
    aborted = await state.engine.drain(state.settings.shutdown_timeout)
    if aborted:
        log.warning("shutdown: aborted %d unfinished requests", aborted)
    if state.settings.corpus_state is not None and state.engine.running:
        try:
            snapshot = await state.engine.call(learned.snapshot)
            size = await asyncio.to_thread(learned.write, Path(state.settings.corpus_state),
                                           snapshot)
            log.info("saved the learned corpus to %s (%d bytes)", state.settings.corpus_state,
                     size)
        except learned.NoLearnedCorpus as e:
            log.warning("not saving --corpus-state: %s", e)
    await state.engine.stop()
    await asyncio.to_thread(state.corpora.close)
    state.encoder.close()


def _add_basic_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        state: ServerState = request.app.state.server
        engine, snap = state.engine, state.engine.snapshot
        status = "ok" if engine.running and engine.accepting else "unavailable"
        body = {"status": status, "model": state.model_name, "kv_free": snap.kv_free,
                "kv_usable": snap.kv_usable, "kv_cached": snap.kv_cached,
                "running": snap.num_running,
                "waiting": snap.num_waiting, "in_flight": engine.num_in_flight,
                "engine_failures": engine.failures}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state: ServerState = request.app.state.server
        corpus_tokens = sum(state.corpora.list().values())
        return Response(state.metrics.render(state.engine.snapshot, corpus_tokens),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        state: ServerState = request.app.state.server
        return {"object": "list",
                "data": [_model_card(state, name) for name in completions.served_names(state)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> dict[str, Any]:
        state: ServerState = request.app.state.server
        completions.check_model(state, model)
        return _model_card(state, model)


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    """`root`: the served name every alias stands for (as vLLM's cards say)."""
    return {"id": name, "object": "model", "created": state.created,
            "owned_by": "ngramspec", "root": state.model_name,
            "max_model_len": state.max_model_len}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(ApiError(400, first["msg"], param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = ApiError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        error = ApiError(500, "internal server error", type="server_error")
        return JSONResponse(error.body(), status_code=500)


class RequestCounter:
    """Counts requests by route and status code (unknown paths share one label)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.counter = state.metrics.requests

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]  # stays 500 if the app dies before answering

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.counter.labels(_route(scope.get("path", "")), str(status[0])).inc()


def _route(path: str) -> str:
    if path in ROUTES:
        return path
    if path.startswith("/v1/corpora/"):
        return "/v1/corpora/{name}"
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"
