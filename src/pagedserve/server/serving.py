"""Requests into engine requests: validation, then the engine's deltas as streams.

Everything that can be wrong with a request is found here before it reaches the engine:
parameters (SamplingParams), prompts (tokenize_prompt), context length (check_length). Both
protocols' renderers (server/completions.py, server/chat.py, server/grpc_server.py) then
consume `generate`: one `RequestStream` per prompt and its events, metrics recorded once here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import jinja2

from pagedserve.async_engine import AsyncEngine, EngineStepError
from pagedserve.output_stream import OutputProcessor, RequestStream
from pagedserve.outputs import CompletionDelta, Usage
from pagedserve.sampling_params import SamplingParams
from pagedserve.server import protocol as P
from pagedserve.server.constraints import OutputPlan, chat_plan, completion_plan
from pagedserve.server.errors import APIError, bad_request, engine_error, param_from_value_error
from pagedserve.server.logprobs import TokenText
from pagedserve.server.metrics import ServerMetrics
from pagedserve.structured.compiler import GrammarError
from pagedserve.structured.spec import StructuredSpec
from pagedserve.tools import prompt as tool_prompt


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # the prompt as text, when known (echo)


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

    def prepare_completion(
        self, req: P.CompletionRequest
    ) -> tuple[list[Prompt], SamplingParams, OutputPlan]:
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

    async def compile_grammars(self, plan: OutputPlan) -> None:
        """Build the plan's grammars into the engine's cache, off the event loop; a 400 naming
        the field of one that fails. The request waits here; the engine never does."""
        for spec, param in plan.checks:
            try:
                await asyncio.wrap_future(self.engine.grammars.compile_async(spec))
            except GrammarError as e:
                raise bad_request(f"{param}: {e}", param) from None

    # ---- generation ----------------------------------------------------------------------
    @staticmethod
    def streams(
        prompts: list[Prompt],
        params: SamplingParams,
        base_id: str,
        processor: Callable[[int], OutputProcessor] | None = None,
    ) -> list[RequestStream]:
        """One engine request per prompt, `{base_id}-{i}`."""
        return [
            RequestStream(
                f"{base_id}-{i}", p.ids, params.n, p.text, params.logprobs is not None, processor
            )
            for i, p in enumerate(prompts)
        ]

    async def _generate_one(
        self, stream: RequestStream, params: SamplingParams, arrival: float, protocol: str
    ) -> AsyncIterator[list[CompletionDelta]]:
        failed = False
        gen = self.async_engine.generate(
            stream.prompt_token_ids, params, stream.request_id, arrival, stream
        )
        try:
            async for s in gen:
                yield s.events
        except BaseException as e:
            failed = not isinstance(e, asyncio.CancelledError | GeneratorExit)
            raise
        finally:
            await gen.aclose()  # aborts the engine request if it has not finished
            if failed:
                self.metrics.record_error(params.n, protocol)
            else:
                if not stream.finished:  # the client went away: the engine aborted it
                    stream.abort()
                self.metrics.record_finished(stream, protocol)

    async def generate(
        self,
        streams: list[RequestStream],
        params: SamplingParams,
        arrival: float,
        protocol: str,  # the metrics label
    ) -> AsyncIterator[tuple[int, list[CompletionDelta]]]:
        """Run every stream's engine request; yields (stream index, the events of an update).
        Engine errors are raised as APIError."""
        try:
            async for item in self._merged(streams, params, arrival, protocol):
                yield item
        except (ValueError, EngineStepError) as e:
            raise engine_error(e) from e

    async def _merged(
        self, streams: list[RequestStream], params: SamplingParams, arrival: float, protocol: str
    ) -> AsyncIterator[tuple[int, list[CompletionDelta]]]:
        if len(streams) == 1:
            gen = self._generate_one(streams[0], params, arrival, protocol)
            try:
                async for events in gen:
                    yield 0, events
            finally:
                await gen.aclose()
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            gen = self._generate_one(stream, params, arrival, protocol)
            try:
                async for events in gen:
                    merged.put_nowait((i, events))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                merged.put_nowait((i, e))
            finally:
                await gen.aclose()
                merged.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
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

    async def collect(
        self, streams: list[RequestStream], params: SamplingParams, arrival: float, protocol: str
    ) -> None:
        """Run the streams to their end (their outputs are then whole)."""
        gen = self.generate(streams, params, arrival, protocol)
        try:
            async for _ in gen:
                pass
        finally:
            await gen.aclose()


def total_usage(streams: list[RequestStream]) -> Usage:
    return sum((s.usage for s in streams), Usage())
