"""Completions and chat completions: request -> validated engine requests -> JSON or SSE.

Everything that can be wrong with a request is found here before it reaches the engine:
parameters (SamplingParams), prompts (tokenize_prompt), context length (check_length).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import lru_cache

import jinja2
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.async_engine import AsyncEngine, EngineStepError, aborted_output
from pagedserve.outputs import RequestOutput, TokenLogprobs
from pagedserve.sampling_params import SamplingParams
from pagedserve.server import protocol as P
from pagedserve.server.constraints import OutputPlan, chat_plan, compile_checks, completion_plan
from pagedserve.server.errors import APIError, bad_request, param_from_value_error
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.tool_output import ToolCallRenderer, response_message
from pagedserve.structured.spec import StructuredSpec
from pagedserve.tools import prompt as tool_prompt

PROTOCOL = "http"
_LOGPROB_FLOOR = -9999.0


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # the prompt as text, when known (echo)


class TokenText:
    """Each token's text and exact bytes, for logprobs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._byte_decoder: dict[str, int] | None = None
        try:
            spec = json.loads(tokenizer.backend_tokenizer.to_str())
            if (spec.get("decoder") or {}).get("type") == "ByteLevel":
                self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        except (AttributeError, ValueError, TypeError):
            pass
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> tuple[int, ...]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self._byte_decoder is not None and piece and all(c in self._byte_decoder for c in piece):
            return tuple(self._byte_decoder[c] for c in piece)
        if piece and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return (int(piece[3:5], 16),)  # sentencepiece byte fallback
        return tuple(self._text(token_id).encode("utf-8"))


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _LOGPROB_FLOOR


def _sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


_DONE = "data: [DONE]\n\n"


class Slot:
    """One admitted request's place in the concurrency limit; release() is idempotent."""

    def __init__(self, release: Callable[[], None]):
        self._release = release
        self._held = True
        self.handed_off = False  # True once a streaming response owns it

    def release(self) -> None:
        if self._held:
            self._held = False
            self._release()


class SlotStreamingResponse(StreamingResponse):
    """A streaming response that frees its slot and closes its stream however it ends."""

    def __init__(self, content: AsyncIterator[str], slot: Slot):
        super().__init__(content, media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"
        self._slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._slot.release()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it (aborting its engine requests)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        watch.cancel()
    if work.cancelled() or not work.done():
        await asyncio.gather(work, return_exceptions=True)
        raise ClientGone()
    return work.result()


class OpenAIServing:
    def __init__(self, async_engine: AsyncEngine, served_model_name: str, metrics: ServerMetrics):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = served_model_name
        self.metrics = metrics
        self.tokens = TokenText(self.tokenizer)

    # ---- validation ----------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )

    def _sampling_params(
        self,
        req: P._SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        rename,
        structured: StructuredSpec | None,
    ) -> SamplingParams:
        if req.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        vocab = self.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in req.stop_token_ids or []):
            raise bad_request(f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")
        if req.stream_options is not None and not req.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k in (None, 0) else req.top_k,
                min_p=req.min_p or 0.0,
                repetition_penalty=1.0
                if req.repetition_penalty is None
                else req.repetition_penalty,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids or [],
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured=structured,
            )
        except ValueError as e:
            raise bad_request(str(e), param_from_value_error(e, rename)) from None

    def _check_prompt(self, prompt: Prompt, params: SamplingParams, length_param: str, pname: str):
        if not prompt.ids:
            raise bad_request(f"{pname} must not be empty", pname)
        try:
            self.engine.check_length(len(prompt.ids), params)
        except ValueError as e:
            raise bad_request(str(e), length_param if params.max_tokens else pname) from None

    def _tokenize(self, prompt: str | list[int], param: str = "prompt") -> Prompt:
        try:
            text, ids = self.engine.tokenize_prompt(prompt)
        except ValueError as e:
            raise bad_request(str(e), param) from None
        return Prompt(ids, text)

    def chat_prompt(
        self,
        messages: list[P.ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ):
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        conversation = []
        for m in messages:
            msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            conversation.append(msg)
        renders_tools = tool_prompt.template_renders_tools(self.tokenizer.chat_template)
        conversation, extra = tool_prompt.for_template(conversation, tools, renders_tools)
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
            )
        except (jinja2.TemplateError, ValueError) as e:
            raise bad_request(
                f"messages do not fit the model's chat template: {e}", "messages"
            ) from None
        return Prompt(self.tokenizer.encode(text, add_special_tokens=False), text)

    def prepare_completion(self, req: P.CompletionRequest) -> tuple[list[Prompt], SamplingParams]:
        self.check_model(req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (use n)", "best_of")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.echo and req.logprobs is not None:
            raise bad_request(
                "echo together with logprobs is not supported (prompt logprobs are not computed)",
                "logprobs",
            )
        plan = completion_plan(req)
        params = self._sampling_params(req, req.max_tokens, req.logprobs, None, plan.spec)
        raw = req.prompt
        if isinstance(raw, list) and raw and not isinstance(raw[0], int):
            items: list[str | list[int]] = list(raw)
        else:
            items = [raw]
        if not items:
            raise bad_request("prompt must not be empty", "prompt")
        prompts = []
        for i, item in enumerate(items):
            pname = "prompt" if len(items) == 1 else f"prompt[{i}]"
            p = self._tokenize(item, pname)
            self._check_prompt(p, params, "max_tokens", pname)
            prompts.append(p)
        return prompts, params, plan

    def prepare_chat(
        self, req: P.ChatCompletionRequest
    ) -> tuple[Prompt, SamplingParams, OutputPlan]:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        max_param = (
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        )
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        rename = {"max_tokens": max_param, "logprobs": "top_logprobs"}
        plan = chat_plan(req)
        params = self._sampling_params(req, max_tokens, logprobs, rename, plan.spec)
        prompt = self.chat_prompt(req.messages, tools=plan.tools)
        self._check_prompt(prompt, params, max_param, "messages")
        return prompt, params, plan

    # ---- generation ----------------------------------------------------------------------
    async def _generate_one(
        self, prompt: Prompt, params: SamplingParams, rid: str, arrival: float, protocol: str
    ) -> AsyncIterator[RequestOutput]:
        last: RequestOutput | None = None
        failed = False
        gen = self.async_engine.generate(prompt.ids, params, rid, arrival)
        try:
            async for out in gen:
                last = out
                yield out
        except BaseException as e:
            failed = not isinstance(e, asyncio.CancelledError | GeneratorExit)
            raise
        finally:
            await gen.aclose()  # aborts the engine request if it has not finished
            if failed:
                self.metrics.record_error(params.n, protocol)
            elif last is not None and last.finished:
                self.metrics.record_finished(last, protocol)
            else:  # the client went away: the engine aborted it
                self.metrics.record_finished(
                    aborted_output(rid, prompt.ids, params, last), protocol
                )

    async def _generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        base_id: str,
        arrival: float,
        protocol: str = PROTOCOL,  # the metrics label: gRPC shares this path
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt's engine request, as (prompt index, cumulative output)."""
        if len(prompts) == 1:
            gen = self._generate_one(prompts[0], params, f"{base_id}-0", arrival, protocol)
            try:
                async for out in gen:
                    yield 0, out
            finally:
                await gen.aclose()
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, prompt: Prompt) -> None:
            gen = self._generate_one(prompt, params, f"{base_id}-{i}", arrival, protocol)
            try:
                async for out in gen:
                    merged.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                merged.put_nowait((i, e))
            finally:
                await gen.aclose()
                merged.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _engine_error(e: Exception) -> APIError:
        if isinstance(e, ValueError):
            return bad_request(str(e))
        if isinstance(e, EngineStepError):
            return APIError(500, str(e), code="engine_error")
        return APIError(500, f"internal error: {type(e).__name__}: {e}")

    async def _collect(self, prompts, params, base_id, arrival) -> list[RequestOutput]:
        final: dict[int, RequestOutput] = {}
        gen = self._generate(prompts, params, base_id, arrival)
        try:
            async for i, out in gen:
                final[i] = out
        except (ValueError, EngineStepError) as e:
            raise self._engine_error(e) from e
        finally:
            await gen.aclose()
        return [final[i] for i in range(len(prompts))]

    # ---- logprobs ------------------------------------------------------------------------
    def completion_logprobs(
        self, token_ids: list[int], entries: list[TokenLogprobs], offset: int
    ) -> tuple[P.CompletionLogprobs, int]:
        lp = P.CompletionLogprobs()
        text = self.tokens.text
        for tid, entry in zip(token_ids, entries, strict=False):
            piece = text(tid)
            lp.tokens.append(piece)
            lp.token_logprobs.append(_lp(entry.get(tid, _LOGPROB_FLOOR)))
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            lp.top_logprobs.append({text(t): _lp(v) for t, v in ranked})
            lp.text_offset.append(offset)
            offset += len(piece)
        return lp, offset

    def chat_logprobs(
        self, token_ids: list[int], entries: list[TokenLogprobs], top_n: int
    ) -> P.ChatLogprobs:
        content = []
        text, raw = self.tokens.text, self.tokens.bytes
        for tid, entry in zip(token_ids, entries, strict=False):
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
            content.append(
                P.ChatTokenLogprob(
                    token=text(tid),
                    logprob=_lp(entry.get(tid, _LOGPROB_FLOOR)),
                    bytes=list(raw(tid)),
                    top_logprobs=[
                        P.TopLogprob(token=text(t), logprob=_lp(v), bytes=list(raw(t)))
                        for t, v in ranked
                    ],
                )
            )
        return P.ChatLogprobs(content=content)

    # ---- /v1/completions -----------------------------------------------------------------
    async def completions(
        self, req: P.CompletionRequest, request: Request, slot: Slot, arrival: float
    ) -> Response:
        prompts, params, plan = self.prepare_completion(req)
        await compile_checks(self.engine.grammars, plan.checks)
        if req.echo:
            for p in prompts:
                if p.text is None:
                    p.text = self.tokenizer.decode(p.ids)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            stream = self._completion_stream(req, prompts, params, rid, arrival, include_usage)
            return SlotStreamingResponse(stream, slot)
        try:
            outs = await _unless_disconnected(request, self._collect(prompts, params, rid, arrival))
        finally:
            slot.release()
        choices = []
        completion_tokens = 0
        for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                prefix = prompt.text if req.echo else ""
                logprobs = None
                if params.logprobs is not None:
                    logprobs, _ = self.completion_logprobs(o.token_ids, o.logprobs or [], 0)
                choices.append(
                    P.CompletionChoice(
                        index=i * params.n + o.index,
                        text=prefix + o.text,
                        logprobs=logprobs,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                    )
                )
        prompt_tokens = sum(len(p.ids) for p in prompts)
        body = P.CompletionResponse(
            id=rid,
            model=self.model_name,
            choices=choices,
            usage=P.UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
        )
        return Response(body.model_dump_json(), media_type="application/json")

    async def _completion_stream(
        self, req, prompts: list[Prompt], params: SamplingParams, rid: str, arrival: float, usage
    ) -> AsyncIterator[str]:
        created = int(time.time())
        n = params.n
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}
        done: set[int] = set()
        completion_tokens = 0
        gen = self._generate(prompts, params, rid, arrival)
        try:
            async for i, out in gen:
                choices = []
                for o in out.outputs:
                    key = i * n + o.index
                    if key in done:
                        continue
                    first = key not in sent_text
                    t0, k0 = sent_text.get(key, 0), sent_tokens.get(key, 0)
                    delta, new_ids = o.text[t0:], o.token_ids[k0:]
                    if not (delta or new_ids or o.finish_reason or (first and req.echo)):
                        continue
                    if first and req.echo:
                        delta = prompts[i].text + delta
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs, offsets[key] = self.completion_logprobs(
                            new_ids, (o.logprobs or [])[k0:], offsets.get(key, 0)
                        )
                    sent_text[key], sent_tokens[key] = len(o.text), len(o.token_ids)
                    if o.finish_reason:
                        done.add(key)
                        completion_tokens += len(o.token_ids)
                    choices.append(
                        P.CompletionChoice(
                            index=key,
                            text=delta,
                            logprobs=logprobs,
                            finish_reason=o.finish_reason,
                            stop_reason=o.stop_reason,
                        )
                    )
                if choices:
                    yield _sse(
                        P.CompletionChunk(
                            id=rid, created=created, model=self.model_name, choices=choices
                        )
                    )
            if usage:
                prompt_tokens = sum(len(p.ids) for p in prompts)
                yield _sse(
                    P.CompletionChunk(
                        id=rid,
                        created=created,
                        model=self.model_name,
                        choices=[],
                        usage=P.UsageInfo(
                            prompt_tokens=prompt_tokens,
                            completion_tokens=completion_tokens,
                            total_tokens=prompt_tokens + completion_tokens,
                        ),
                    )
                )
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield self._engine_error(e).sse()
        finally:
            await gen.aclose()
        yield _DONE

    # ---- /v1/chat/completions ------------------------------------------------------------
    async def chat(
        self, req: P.ChatCompletionRequest, request: Request, slot: Slot, arrival: float
    ) -> Response:
        prompt, params, plan = self.prepare_chat(req)
        await compile_checks(self.engine.grammars, plan.checks)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        top_n = req.top_logprobs or 0
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            stream = self._chat_stream(
                prompt, params, rid, arrival, top_n, include_usage, plan.parse_tools
            )
            return SlotStreamingResponse(stream, slot)
        try:
            (out,) = await _unless_disconnected(
                request, self._collect([prompt], params, rid, arrival)
            )
        finally:
            slot.release()
        choices = []
        for o in out.outputs:
            logprobs = None
            if params.logprobs is not None:
                logprobs = self.chat_logprobs(o.token_ids, o.logprobs or [], top_n)
            message, finish_reason = response_message(o, plan.parse_tools)
            choices.append(
                P.ChatChoice(
                    index=o.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=o.stop_reason,
                )
            )
        completion_tokens = sum(len(o.token_ids) for o in out.outputs)
        body = P.ChatCompletionResponse(
            id=rid,
            model=self.model_name,
            choices=choices,
            usage=P.UsageInfo(
                prompt_tokens=len(prompt.ids),
                completion_tokens=completion_tokens,
                total_tokens=len(prompt.ids) + completion_tokens,
            ),
        )
        return Response(body.model_dump_json(), media_type="application/json")

    async def _chat_stream(
        self,
        prompt: Prompt,
        params: SamplingParams,
        rid: str,
        arrival: float,
        top_n: int,
        usage,
        parse_tools: bool,
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices, usage_info=None) -> str:
            return _sse(
                P.ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=self.model_name,
                    choices=choices,
                    usage=usage_info,
                )
            )

        gen = self._generate([prompt], params, rid, arrival)
        sent_text = [0] * params.n
        sent_tokens = [0] * params.n
        done = [False] * params.n
        tool_calls = [ToolCallRenderer() if parse_tools else None for _ in range(params.n)]
        completion_tokens = 0
        try:
            yield chunk(
                [
                    P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                    for i in range(params.n)
                ]
            )
            async for _, out in gen:
                choices = []
                for o in out.outputs:
                    i = o.index
                    if done[i]:
                        continue
                    delta, new_ids = o.text[sent_text[i] :], o.token_ids[sent_tokens[i] :]
                    if not (delta or new_ids or o.finish_reason):
                        continue
                    logprobs = None
                    if params.logprobs is not None:
                        entries = (o.logprobs or [])[sent_tokens[i] :]
                        logprobs = self.chat_logprobs(new_ids, entries, top_n)
                    sent_text[i], sent_tokens[i] = len(o.text), len(o.token_ids)
                    if o.finish_reason:
                        done[i] = True
                        completion_tokens += len(o.token_ids)
                    message, finish_reason = P.DeltaMessage(content=delta), o.finish_reason
                    if tool_calls[i] is not None:
                        message, finish_reason = tool_calls[i].delta(o)
                    choices.append(
                        P.ChatStreamChoice(
                            index=i,
                            delta=message,
                            logprobs=logprobs,
                            finish_reason=finish_reason,
                            stop_reason=o.stop_reason,
                        )
                    )
                if choices:
                    yield chunk(choices)
            if usage:
                yield chunk(
                    [],
                    P.UsageInfo(
                        prompt_tokens=len(prompt.ids),
                        completion_tokens=completion_tokens,
                        total_tokens=len(prompt.ids) + completion_tokens,
                    ),
                )
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield self._engine_error(e).sse()
        finally:
            await gen.aclose()
        yield _DONE
