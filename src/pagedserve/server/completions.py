"""/v1/completions: the streams of `OpenAIServing.generate` rendered as JSON or SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pagedserve.output_stream import RequestStream
from pagedserve.outputs import TokenLogprobs
from pagedserve.sampling_params import SamplingParams
from pagedserve.server import protocol as P
from pagedserve.server.errors import APIError, engine_error
from pagedserve.server.http_stream import DONE, SlotStreamingResponse, sse, unless_disconnected
from pagedserve.server.logprobs import TokenText, format_logprobs
from pagedserve.server.serving import OpenAIServing, Prompt, total_usage
from pagedserve.server.state import Slot

PROTOCOL = "http"


def completion_logprobs(
    tokens: TokenText, token_ids: list[int], entries: list[TokenLogprobs], offset: int
) -> tuple[P.CompletionLogprobs, int]:
    """The logprobs of new tokens whose text starts at `offset`; and the offset after them."""
    lp = P.CompletionLogprobs()
    for pos in format_logprobs(tokens, token_ids, entries):
        lp.tokens.append(pos.chosen.token)
        lp.token_logprobs.append(pos.chosen.logprob)
        lp.top_logprobs.append({t.token: t.logprob for t in pos.top})
        lp.text_offset.append(offset)
        offset += len(pos.chosen.token)
    return lp, offset


async def create_completion(
    serving: OpenAIServing, req: P.CompletionRequest, request: Request, slot: Slot, arrival: float
) -> Response:
    prompts, params, plan = serving.prepare_completion(req)
    await serving.compile_grammars(plan)
    if req.echo:
        for p in prompts:
            if p.text is None:
                p.text = serving.tokenizer.decode(p.ids)
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = serving.streams(prompts, params, rid)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = _stream(serving, req, rid, prompts, streams, params, arrival, include_usage)
        return SlotStreamingResponse(chunks, slot)
    try:
        await unless_disconnected(request, serving.collect(streams, params, arrival, PROTOCOL))
    finally:
        slot.release()
    choices = []
    for i, (prompt, stream) in enumerate(zip(prompts, streams, strict=True)):
        for o in stream.outputs:
            prefix = prompt.text if req.echo else ""
            logprobs = None
            if params.logprobs is not None:
                logprobs, _ = completion_logprobs(serving.tokens, o.token_ids, o.logprobs or [], 0)
            choices.append(
                P.CompletionChoice(
                    index=i * params.n + o.index,
                    text=prefix + o.text,
                    logprobs=logprobs,
                    finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                )
            )
    body = P.CompletionResponse(
        id=rid,
        model=serving.model_name,
        choices=choices,
        usage=P.UsageInfo.of(total_usage(streams)),
    )
    return Response(body.model_dump_json(), media_type="application/json")


async def _stream(
    serving: OpenAIServing,
    req: P.CompletionRequest,
    rid: str,
    prompts: list[Prompt],
    streams: list[RequestStream],
    params: SamplingParams,
    arrival: float,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())
    offsets: dict[int, int] = {}  # choice -> text offset of its next token (logprobs)

    def chunk(choices: list[P.CompletionChoice], usage: P.UsageInfo | None = None) -> str:
        return sse(
            P.CompletionChunk(
                id=rid, created=created, model=serving.model_name, choices=choices, usage=usage
            )
        )

    gen = serving.generate(streams, params, arrival, PROTOCOL)
    try:
        async for i, events in gen:
            choices = []
            for e in events:
                key = i * params.n + e.index
                text = e.text
                if req.echo and key not in offsets:
                    text = prompts[i].text + text
                logprobs = None
                if params.logprobs is not None:
                    logprobs, offsets[key] = completion_logprobs(
                        serving.tokens, e.token_ids, e.logprobs or [], offsets.get(key, 0)
                    )
                else:
                    offsets[key] = 0
                choices.append(
                    P.CompletionChoice(
                        index=key,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=e.finish_reason,
                        stop_reason=e.stop_reason,
                    )
                )
            if choices:
                yield chunk(choices)
        if include_usage:
            yield chunk([], P.UsageInfo.of(total_usage(streams)))
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
        yield (e if isinstance(e, APIError) else engine_error(e)).sse()
    finally:
        await gen.aclose()
    yield DONE
