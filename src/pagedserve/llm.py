"""The offline API, shaped like vLLM's: LLM(...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from pagedserve.config import EngineConfig
from pagedserve.engine import LLMEngine
from pagedserve.output_stream import RequestStream
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one per prompt")
        streams: dict[str, RequestStream] = {}
        for prompt, p in zip(prompts, params, strict=True):
            rid = str(next(self._ids))
            state = self.engine.add_request(rid, prompt, p)
            logprobs = p.logprobs is not None
            streams[rid] = RequestStream(rid, state.prompt_token_ids, p.n, state.prompt, logprobs)
        return self._run(streams, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
            for c in conversations
        ]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(ids, sampling_params, use_tqdm)

    def _run(self, streams: dict[str, RequestStream], use_tqdm: bool) -> list[RequestOutput]:
        bar = tqdm(total=len(streams), desc="Generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                stream = streams[delta.request_id]
                stream.update((delta,))
                if stream.finished:
                    bar.update(1)
        bar.close()
        return [s.output() for s in streams.values()]
