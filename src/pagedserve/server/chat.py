"""/v1/chat/completions: the stream of `OpenAIServing.generate` rendered as JSON or SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pagedserve.output_stream import ChoiceStream, RequestStream
from pagedserve.outputs import CompletionDelta, TokenLogprobs
from pagedserve.sampling_params import SamplingParams
from pagedserve.server import protocol as P
from pagedserve.server.errors import APIError, engine_error
from pagedserve.server.http_stream import DONE, SlotStreamingResponse, sse, unless_disconnected
from pagedserve.server.logprobs import TokenText, format_logprobs
from pagedserve.server.serving import OpenAIServing
from pagedserve.server.state import Slot
from pagedserve.tools.parser import ToolCallProcessor

PROTOCOL = "http"


def chat_logprobs(
    tokens: TokenText, token_ids: list[int], entries: list[TokenLogprobs], top_n: int
) -> P.ChatLogprobs:
    raw = tokens.bytes
    return P.ChatLogprobs(
        content=[
            P.ChatTokenLogprob(
                token=pos.chosen.token,
                logprob=pos.chosen.logprob,
                bytes=list(raw(pos.chosen.token_id)),
                top_logprobs=[
                    P.TopLogprob(token=t.token, logprob=t.logprob, bytes=list(raw(t.token_id)))
                    for t in pos.top
                ],
            )
            for pos in format_logprobs(tokens, token_ids, entries, top_n)
        ]
    )


def response_message(o: ChoiceStream) -> P.ChatResponseMessage:
    if not o.tool_calls:
        return P.ChatResponseMessage(content=o.text)
    calls = [
        P.ResponseToolCall(
            id=c.id, function=P.ResponseFunctionCall(name=c.name, arguments=c.arguments)
        )
        for c in o.tool_calls
    ]
    return P.ChatResponseMessage(content=o.text.strip() or None, tool_calls=calls)


def delta_message(e: CompletionDelta) -> P.DeltaMessage:
    if not e.tool_calls:
        return P.DeltaMessage(content=e.text)
    calls = [
        P.DeltaToolCall(
            index=c.index,
            id=c.id,
            type="function" if c.id else None,
            function=P.DeltaFunctionCall(name=c.name, arguments=c.arguments),
        )
        for c in e.tool_calls
    ]
    return P.DeltaMessage(content=e.text or None, tool_calls=calls)


async def create_chat_completion(
    serving: OpenAIServing,
    req: P.ChatCompletionRequest,
    request: Request,
    slot: Slot,
    arrival: float,
) -> Response:
    prompt, params, plan = serving.prepare_chat(req)
    await serving.compile_grammars(plan)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    top_n = req.top_logprobs or 0
    processor = (lambda _: ToolCallProcessor()) if plan.parse_tools else None
    (stream,) = serving.streams([prompt], params, rid, processor)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = _stream(serving, rid, stream, params, arrival, top_n, include_usage)
        return SlotStreamingResponse(chunks, slot)
    try:
        await unless_disconnected(request, serving.collect([stream], params, arrival, PROTOCOL))
    finally:
        slot.release()
    choices = []
    for o in stream.outputs:
        logprobs = None
        if params.logprobs is not None:
            logprobs = chat_logprobs(serving.tokens, o.token_ids, o.logprobs or [], top_n)
        choices.append(
            P.ChatChoice(
                index=o.index,
                message=response_message(o),
                logprobs=logprobs,
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
            )
        )
    body = P.ChatCompletionResponse(
        id=rid, model=serving.model_name, choices=choices, usage=P.UsageInfo.of(stream.usage)
    )
    return Response(body.model_dump_json(), media_type="application/json")


async def _stream(
    serving: OpenAIServing,
    rid: str,
    stream: RequestStream,
    params: SamplingParams,
    arrival: float,
    top_n: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[P.ChatStreamChoice], usage: P.UsageInfo | None = None) -> str:
        return sse(
            P.ChatCompletionChunk(
                id=rid, created=created, model=serving.model_name, choices=choices, usage=usage
            )
        )

    gen = serving.generate([stream], params, arrival, PROTOCOL)
    try:
        yield chunk(
            [
                P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                for i in range(params.n)
            ]
        )
        async for _, events in gen:
            choices = []
            for e in events:
                logprobs = None
                if params.logprobs is not None:
                    logprobs = chat_logprobs(serving.tokens, e.token_ids, e.logprobs or [], top_n)
                choices.append(
                    P.ChatStreamChoice(
                        index=e.index,
                        delta=delta_message(e),
                        logprobs=logprobs,
                        finish_reason=e.finish_reason,
                        stop_reason=e.stop_reason,
                    )
                )
            if choices:
                yield chunk(choices)
        if include_usage:
            yield chunk([], P.UsageInfo.of(stream.usage))
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
        yield (e if isinstance(e, APIError) else engine_error(e)).sse()
    finally:
        await gen.aclose()
    yield DONE
