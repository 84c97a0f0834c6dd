"""The OpenAI-compatible HTTP server: FastAPI app factory and `run_server` on uvicorn.

The app answers at once and loads the engine in a background thread (/health says 503 until
it is ready). Generation requests pass, in order: API key (401), readiness/draining (503),
admission control (429), body size (413), JSON and parameter validation (400/404), and only
then reach the engine. SIGTERM stops admission (503), lets in-flight requests finish within the
grace period, aborts what is left, and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve import __version__
from pagedserve.cpu_kernels import isa
from pagedserve.engine import LLMEngine
from pagedserve.server import chat, completions
from pagedserve.server import protocol as P
from pagedserve.server.completions import PROTOCOL
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import APIError, bad_request, from_validation_error
from pagedserve.server.http_stream import ClientGone, SlotStreamingResponse
from pagedserve.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedserve.server.serving import OpenAIServing
from pagedserve.server.state import ServerState

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_ENDPOINTS = {
    "/health",
    "/version",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
}
# nginx's "client closed request": recorded when the client left before the answer.
CLIENT_CLOSED = 499


async def read_body(request: Request, model: type[M], limit: int) -> M:
    too_large = APIError(
        413,
        f"request body is larger than the limit of {limit} bytes",
        code="request_too_large",
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


class _StatusMetrics:
    """Pure ASGI middleware counting responses by endpoint and status code."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = CLIENT_CLOSED

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope.get("path", "")
        if path.startswith("/v1/models/"):
            path = "/v1/models/{model}"
        elif path not in _ENDPOINTS:
            path = "other"
        try:
            await self.app(scope, receive, send_status)
        except Exception:
            status = 500
            raise
        finally:
            self.metrics.requests.labels(PROTOCOL, path, str(status)).inc()


def create_app(config: ServerConfig, load_engine: Callable[[], LLMEngine]) -> FastAPI:
    state = ServerState(config, load_engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading()
        grpc_server = None
        if config.grpc_port is not None:  # grpc's modules only where it serves: ~0.07 s of start
            from pagedserve.server.grpc_server import start_grpc_server

            grpc_server = await start_grpc_server(state)  # None when it cannot bind
        yield
        if grpc_server is not None:
            await grpc_server.stop()
        await state.shutdown()

    app = FastAPI(
        title="pagedserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.server = state
    app.add_middleware(_StatusMetrics, metrics=state.metrics)

    # ---- errors: always OpenAI's shape -------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in err["loc"][1:]) or None
        return bad_request(f"{param}: {err['msg']}" if param else err["msg"], param).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}").response()

    # ---- open routes -------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        state.ready()
        if not state.async_engine.is_running:
            raise APIError(503, "the engine loop has stopped", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        engine = state.async_engine  # None while the model loads
        on_cpu = engine is not None and engine.engine.device.type == "cpu"
        level = isa.kernel_level() if on_cpu else None
        return JSONResponse({"version": __version__, "cpu_kernel_level": level})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    # ---- routes behind the API key -----------------------------------------------------
    async def require_api_key(request: Request) -> None:
        if not state.authorized(request.headers.get("authorization", "")):
            raise APIError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    api = APIRouter(dependencies=[Depends(require_api_key)])

    def model_card(serving: OpenAIServing) -> P.ModelCard:
        return P.ModelCard(
            id=serving.model_name,
            created=state.created,
            root=serving.engine.model_name,
            max_model_len=serving.engine.max_model_len,
        )

    @api.get("/v1/models")
    async def list_models() -> Response:
        serving = state.ready()
        body = P.ModelList(data=[model_card(serving)])
        return Response(body.model_dump_json(), media_type="application/json")

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        serving = state.ready()
        serving.check_model(model_id)
        return Response(model_card(serving).model_dump_json(), media_type="application/json")

    async def generation(request: Request, model: type[M], handler) -> Response:
        arrival = time.monotonic()
        serving = state.ready()
        slot = state.admit(PROTOCOL)
        try:
            req = await read_body(request, model, config.max_request_body_bytes)
            response = await handler(serving, req, request, slot, arrival)
            # A streaming response owns its slot from here on and frees it when it ends.
            slot.handed_off = isinstance(response, SlotStreamingResponse)
            return response
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            if not slot.handed_off:
                slot.release()

    @api.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await generation(request, P.CompletionRequest, completions.create_completion)

    @api.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await generation(request, P.ChatCompletionRequest, chat.create_chat_completion)

    @api.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        serving = state.ready()
        req = await read_body(request, P.TokenizeRequest, config.max_request_body_bytes)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = serving.chat_prompt(req.messages, req.add_generation_prompt).ids
        else:
            ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        body = P.TokenizeResponse(
            tokens=ids, count=len(ids), max_model_len=serving.engine.max_model_len
        )
        return Response(body.model_dump_json(), media_type="application/json")

    @api.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        serving = state.ready()
        req = await read_body(request, P.DetokenizeRequest, config.max_request_body_bytes)
        serving.check_model(req.model)
        vocab = serving.engine.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise bad_request(f"tokens must be integers in [0, {vocab})", "tokens")
        text = serving.tokenizer.decode(req.tokens)
        body = P.DetokenizeResponse(prompt=text)
        return Response(body.model_dump_json(), media_type="application/json")

    app.include_router(api)
    return app


class _Server(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT turned into a graceful drain (a second signal forces)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self.state.loop
        if self._draining or loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        logger.info("received %s", signal.Signals(sig).name)
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await self.state.drain()
        finally:
            self.should_exit = True


def run_server(load_engine: Callable[[], LLMEngine], server_config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; the process exit code. `load_engine` runs in a thread while
    /health answers 503."""
    app = create_app(server_config, load_engine)
    state: ServerState = app.state.server
    uv_config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        loop="uvloop",
        http="httptools",
        log_config=None,
        log_level="info",
        access_log=server_config.access_log,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    server = _Server(uv_config, state)

    def request_exit() -> None:
        server.should_exit = True

    state.request_exit = request_exit
    server.run()
    if state.load_error is not None:
        if isinstance(state.load_error, ValueError):
            raise state.load_error  # the CLI prints it as one line and exits 2
        return 1
    return 1 if state.engine_error is not None else 0
