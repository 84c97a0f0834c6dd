"""The gRPC API (proto/pagedserve/v1/generation.proto) on grpcio's asyncio server.

It runs in the HTTP server's process and event loop and shares its `ServerState`: the same
AsyncEngine (so requests of both protocols are batched together in every step), the same
in-flight limit, readiness and draining, API key and metrics (labelled protocol="grpc").
A GenerateRequest is turned into the HTTP API's CompletionRequest and validated by the same
code as /v1/completions, so both protocols accept and refuse exactly the same parameters.

Beside `pagedserve.v1.Generation` it serves the standard health service (NOT_SERVING while the
model loads or the server drains) and server reflection.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from pagedserve.output_stream import ChoiceStream, RequestStream
from pagedserve.outputs import CompletionDelta
from pagedserve.sampling_params import SamplingParams
from pagedserve.server import protocol as P
from pagedserve.server.constraints import OutputPlan
from pagedserve.server.errors import APIError, bad_request, from_validation_error
from pagedserve.server.logprobs import TokenText, format_logprobs
from pagedserve.server.serving import OpenAIServing
from pagedserve.server.state import ServerState, Slot
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

PROTOCOL = "grpc"
DEADLINE_SLACK_S = 0.25
SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Readiness changes (loaded, draining, engine died) are noticed by polling ServerState, which
# keeps the HTTP server free of gRPC hooks; a probe sees a change within this delay.
_HEALTH_POLL_SECONDS = 0.1

# The HTTP status of an APIError -> the gRPC code that means the same.
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "grammar_dead_end": pb.FINISH_REASON_GRAMMAR_DEAD_END,
}
# GenerateRequest fields with presence, passed on to CompletionRequest only when set (so that
# unset ones take the HTTP API's defaults).
_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "logprobs",
    "n",
)


def _code(e: APIError) -> grpc.StatusCode:
    return _CODES.get(
        e.status,
        grpc.StatusCode.INTERNAL if e.status >= 500 else grpc.StatusCode.INVALID_ARGUMENT,
    )


@dataclass
class _Job:
    """One admitted, validated generation request."""

    stream: RequestStream
    params: SamplingParams
    arrival: float
    slot: Slot
    plan: OutputPlan  # its grammars are compiled before the request reaches the engine


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, state: ServerState):
        self.state = state

    # ---- the frame of every call: auth, errors -> status codes, metrics ----------------------
    @asynccontextmanager
    async def _call(self, context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[None]:
        status = grpc.StatusCode.OK
        try:
            self._authenticate(context)
            yield
        except APIError as e:
            status = _code(e)
            message = e.message
            if e.param and not message.startswith(e.param):
                message = f"{e.param}: {message}"
            trailing = (("error-param", e.param),) if e.param else ()
            await context.abort(status, message, trailing_metadata=trailing)
        except (asyncio.CancelledError, GeneratorExit):
            # The client cancelled or its deadline passed: grpc cancels this task, and the
            # generator's cleanup has aborted the engine request (freeing its pages).
            # A client cancels at its own deadline, which runs a little ahead of ours (the
            # request took time to arrive): a cancel that close to the deadline is the deadline.
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= DEADLINE_SLACK_S
            status = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug; the client gets INTERNAL, the log the rest
            logger.exception("unhandled error in gRPC %s", method)
            status = grpc.StatusCode.INTERNAL
            await context.abort(status, f"internal server error: {type(e).__name__}")
        finally:
            self.state.metrics.requests.labels(PROTOCOL, f"/{SERVICE}/{method}", status.name).inc()

    def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        value = metadata.get("authorization", "")
        if not self.state.authorized(value if isinstance(value, str) else ""):
            raise APIError(
                401,
                "invalid or missing API key: send the metadata 'authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    # ---- requests -> the HTTP API's validation -----------------------------------------------
    @staticmethod
    def _completion_request(m: pb.GenerateRequest) -> P.CompletionRequest:
        which = m.WhichOneof("prompt")
        if which is None:
            raise bad_request("prompt: set text or token_ids", "prompt")
        fields: dict = {
            "prompt": m.text if which == "text" else list(m.token_ids.ids),
            "ignore_eos": m.ignore_eos,
            "min_tokens": m.min_tokens,
            "include_stop_str_in_output": m.include_stop_str_in_output,
        }
        fields.update({name: getattr(m, name) for name in _OPTIONAL_FIELDS if m.HasField(name)})
        if m.stop:
            fields["stop"] = list(m.stop)
        if m.stop_token_ids:
            fields["stop_token_ids"] = list(m.stop_token_ids)
        if m.HasField("structured_outputs"):
            so = m.structured_outputs
            given = {k: getattr(so, k) for k in ("json", "regex", "grammar") if so.HasField(k)}
            if so.choice:
                given["choice"] = list(so.choice)
            fields["structured_outputs"] = given
        try:
            return P.CompletionRequest.model_validate(fields)
        except ValidationError as e:
            raise from_validation_error(e) from None

    def _start(self, m: pb.GenerateRequest) -> tuple[OpenAIServing, _Job]:
        """Readiness (UNAVAILABLE), admission (RESOURCE_EXHAUSTED), then validation."""
        arrival = time.monotonic()
        serving = self.state.ready()
        slot = self.state.admit(PROTOCOL)
        try:
            (prompt,), params, plan = serving.prepare_completion(self._completion_request(m))
        except BaseException:
            slot.release()
            raise
        rid = m.request_id or f"grpc-{uuid.uuid4().hex}"
        stream = RequestStream(rid, prompt.ids, params.n, prompt.text, params.logprobs is not None)
        return serving, _Job(stream, params, arrival, slot, plan)

    async def _events(
        self, serving: OpenAIServing, job: _Job
    ) -> AsyncIterator[list[CompletionDelta]]:
        gen = serving.generate([job.stream], job.params, job.arrival, PROTOCOL)
        try:
            await serving.compile_grammars(job.plan)
            async for _, events in gen:
                yield events
        finally:
            await gen.aclose()  # aborts the engine request when it has not finished
            job.slot.release()

    # ---- responses ---------------------------------------------------------------------------
    @staticmethod
    def _completion(
        tokens: TokenText, o: CompletionDelta | ChoiceStream, logprobs: bool
    ) -> pb.Completion:
        c = pb.Completion(index=o.index, token_ids=o.token_ids, text=o.text)
        if logprobs:
            c.logprobs.extend(
                pb.TokenLogprob(
                    token_id=pos.chosen.token_id,
                    token=pos.chosen.token,
                    logprob=pos.chosen.logprob,
                    top_logprobs=[
                        pb.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob)
                        for t in pos.top
                    ],
                )
                for pos in format_logprobs(tokens, o.token_ids, o.logprobs or [])
            )
        if o.finish_reason is not None:
            c.finish_reason = _FINISH.get(o.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
            if isinstance(o.stop_reason, str):
                c.stop_string = o.stop_reason
            elif isinstance(o.stop_reason, int):
                c.stop_token_id = o.stop_reason
        return c

    @staticmethod
    def _usage(stream: RequestStream) -> pb.Usage:
        u = stream.usage
        return pb.Usage(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            total_tokens=u.total_tokens,
        )

    # ---- the service -------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        async with self._call(context, "Generate"):
            serving, job = self._start(request)
            async for _ in self._events(serving, job):
                pass
            logprobs = job.params.logprobs is not None
            stream = job.stream
            return pb.GenerateResponse(
                request_id=stream.request_id,
                completions=[self._completion(serving.tokens, o, logprobs) for o in stream.outputs],
                usage=self._usage(stream),
            )

    async def GenerateStream(
        self, request: pb.GenerateRequest, context
    ) -> AsyncIterator[pb.GenerateResponse]:
        async with self._call(context, "GenerateStream"):
            serving, job = self._start(request)
            logprobs = job.params.logprobs is not None
            stream = job.stream
            async for events in self._events(serving, job):
                msg = pb.GenerateResponse(request_id=stream.request_id)
                msg.completions.extend(
                    self._completion(serving.tokens, e, logprobs) for e in events
                )
                if stream.finished:
                    msg.usage.CopyFrom(self._usage(stream))
                if msg.completions or stream.finished:
                    yield msg

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        async with self._call(context, "Tokenize"):
            serving = self.state.ready()
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = serving.tokenizer.encode(request.text, add_special_tokens=special)
            return pb.TokenizeResponse(token_ids=ids, max_model_len=serving.engine.max_model_len)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        async with self._call(context, "Detokenize"):
            serving = self.state.ready()
            vocab = serving.engine.model_config.vocab_size
            if any(t >= vocab for t in request.token_ids):
                raise bad_request(f"token_ids must be in [0, {vocab})", "token_ids")
            return pb.DetokenizeResponse(text=serving.tokenizer.decode(list(request.token_ids)))

    async def ModelInfo(self, request: pb.ModelInfoRequest, context) -> pb.ModelInfoResponse:
        async with self._call(context, "ModelInfo"):
            serving = self.state.ready()
            engine = serving.engine
            return pb.ModelInfoResponse(
                model=serving.model_name,
                root=engine.model_name,
                max_model_len=engine.max_model_len,
                vocab_size=engine.model_config.vocab_size,
                dtype=str(engine.dtype).removeprefix("torch."),
                device=str(engine.device),
                kv_cache_tokens=engine.stats().kv_tokens_total,
            )


class GrpcServer:
    """The running gRPC server and the task that keeps its health status current."""

    def __init__(self, state: ServerState, server: grpc.aio.Server, port: int):
        self.state = state
        self.server = server
        self.port = port
        self.health = health.aio.HealthServicer()
        self._watch: asyncio.Task | None = None

    async def _watch_readiness(self) -> None:
        last = None
        while True:
            status = _SERVING if self.state.serving_now else _NOT_SERVING
            if status != last:
                for service in ("", SERVICE):
                    await self.health.set(service, status)
                last = status
            await asyncio.sleep(_HEALTH_POLL_SECONDS)

    async def stop(self, grace: float = 5.0) -> None:
        """Called after the HTTP server's drain: in-flight calls have finished or been aborted."""
        await self.health.enter_graceful_shutdown()
        if self._watch is not None:
            self._watch.cancel()
        await self.server.stop(grace)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def start_grpc_server(state: ServerState) -> GrpcServer | None:
    """Start the gRPC server on `grpc_port` (None when it cannot bind)."""
    cfg = state.config
    server = grpc.aio.server(
        options=[
            # Without this grpc binds a port another process already serves, silently.
            ("grpc.so_reuseport", 0),
            # The HTTP body limit applies to gRPC messages too (RESOURCE_EXHAUSTED above it).
            ("grpc.max_receive_message_length", cfg.max_request_body_bytes),
        ]
    )
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(state), server)
    address = _address(cfg.host, cfg.grpc_port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        port, error = 0, e
    else:
        error = None
    if not port:
        state.load_error = OSError(f"cannot listen for gRPC on {address}: {error or 'bind failed'}")
        logger.error("%s", state.load_error)
        state.request_exit()
        return None
    front = GrpcServer(state, server, port)
    for service in ("", SERVICE):
        await front.health.set(service, _NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(front.health, server)
    health_service = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((SERVICE, health_service, reflection.SERVICE_NAME), server)
    await server.start()
    front._watch = asyncio.create_task(front._watch_readiness())
    logger.info("gRPC API (%s, health, reflection) on %s", SERVICE, _address(cfg.host, port))
    return front
