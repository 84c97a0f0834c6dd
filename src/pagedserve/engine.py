"""The engine: requests in, one batched model step at a time, per-request deltas back.

It owns the tokenizer, the scheduler, the block manager, the model runner and the sampler,
and knows nothing of HTTP. `step()` is called in a loop by the offline `LLM` or by the async
engine's thread.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

import torch

from pagedserve import detokenizer
from pagedserve.block_manager import BlockManager
from pagedserve.config import EngineConfig
from pagedserve.cpu_kernels import isa
from pagedserve.distributed.sharding import ShardPlan
from pagedserve.executor import Executor, start_executor
from pagedserve.loading import LoadSpec
from pagedserve.model_runner import ModelRunner
from pagedserve.models.loader import ModelSource, load_config, load_tokenizer
from pagedserve.models.quant_weight import packed_kernels_available
from pagedserve.outputs import CompletionDelta, RequestDelta, RequestMetrics, TokenLogprobs
from pagedserve.sampler import sample
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler
from pagedserve.sequence import Sequence, SequenceStatus
from pagedserve.structured.compiler import GrammarCompiler
from pagedserve.structured.masks import MaskFiller

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = {**DTYPES, "int8": torch.int8}


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


@dataclass
class EngineCounters:
    """Cumulative counts since start, read by metrics and the periodic log line."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    page_size: int
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_cached: int
    kv_slots_allocated: int
    kv_slots_filled: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def kv_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total

    @property
    def kv_tokens_total(self) -> int:
        return self.kv_pages_total * self.page_size

    @property
    def kv_waste(self) -> float:
        """Allocated but unfilled slots, as a fraction of the slots live sequences hold."""
        allocated = self.kv_slots_allocated
        return (allocated - self.kv_slots_filled) / allocated if allocated else 0.0


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA, and on a CPU whose kernel level computes it natively (README,
    "CPUs: kernel levels and dtype"), float32 on other CPUs. An explicit bfloat16 that this CPU
    would only emulate is refused here, before anything loads (oneDNN refuses it mid-load)."""
    if device.type != "cpu":
        return torch.bfloat16 if name == "auto" else DTYPES[name]
    logger.info("CPU: %s", isa.describe())
    native = isa.native_bf16()
    if name == "auto":
        return torch.bfloat16 if native else torch.float32
    if name == "bfloat16" and not native:
        cpu = isa.cpu_info()
        why = (
            f"the CPU kernel level is capped at {isa.kernel_level()} (${isa.CAP_ENV})"
            if cpu.has_native_bf16()
            else f"this CPU ({cpu.model}) has no AVX512_BF16 or AMX-BF16"
        )
        raise ValueError(
            f"--dtype bfloat16 needs native bfloat16 on CPU, but {why}: use --dtype auto or float32"
        )
    return DTYPES[name]


def _pick_kv_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pages' dtype (EngineConfig.kv_cache_dtype's help). 16-bit pages under an
    automatic float32 follow the rule of --dtype: auto is the fast choice, float32 named
    explicitly the exact one (greedy output equal to transformers'). Pages of another dtype
    than the activations' are read by the CPU kernels only (not by Triton's): 16-bit under
    float32, int8 (attention/int8_pages.py) under any activations."""
    cpu_kernels = device.type == "cpu" and config.attention_backend != "triton"
    if config.kv_cache_dtype == "auto":
        if not (cpu_kernels and dtype == torch.float32 and config.dtype == "auto"):
            return dtype
        # float16 where the level widens it in hardware (F16C), bfloat16 (a shift) in the
        # portable kernels, whose float16 conversion is bit operations: decode attention over
        # bfloat16 pages 1.3-1.5x faster there (scripts/bench_cpu_decode_attention.py).
        return torch.bfloat16 if isa.kernel_level() == "generic" else torch.float16
    kv = KV_DTYPES[config.kv_cache_dtype]
    if kv == dtype:
        return kv
    model = str(dtype).removeprefix("torch.")
    readable = kv == torch.int8 or (dtype == torch.float32 and kv != torch.float32)
    if not cpu_kernels or not readable:
        raise ValueError(
            f"--kv-cache-dtype {config.kv_cache_dtype} under a {model} model on"
            f" {device.type}: a KV cache of another dtype than the model's is int8, or float16"
            " or bfloat16 under float32, read by the CPU attention kernels (use"
            " --kv-cache-dtype auto)"
        )
    return kv


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = _pick_device(config.device)
        self.dtype = _pick_dtype(config.dtype, self.device)
        self.kv_dtype = _pick_kv_dtype(config, self.dtype, self.device)
        self.source = ModelSource.resolve(config.model)
        self.model_config = cfg = load_config(self.source)
        if config.tensor_parallel_size > 1:
            ShardPlan.check(cfg, config.tensor_parallel_size)  # fail before the slow parts
        self.tokenizer = load_tokenizer(self.source)
        self._decode = detokenizer.decoder(self.tokenizer)
        self.eos_token_ids = sorted(
            set(cfg.eos_token_ids)
            | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        )
        max_positions = config.max_model_len or cfg.max_context
        keep_quant = (
            config.quantization == "auto"
            and self.device.type == "cpu"
            and self.source.kind == "gguf"
            and packed_kernels_available(self.dtype)
        )
        # llama.cpp's int8 products unless float32 was asked for by name: exact float32
        # products are then kept (greedy output equal to transformers').
        int8_activations = keep_quant and config.dtype != "float32"
        page_size = config.block_size
        spec = LoadSpec(
            config,
            self.source,
            cfg,
            self.dtype,
            self.kv_dtype,
            self.device.type,
            max_positions,
            keep_quant,
            int8_activations,
        )
        # Under tensor parallelism rank 0 runs in this process, the others in workers.
        self.runner: Executor = start_executor(spec, self.device)
        self.backend = self.runner.backend
        self.model = self.runner.model if isinstance(self.runner, ModelRunner) else None
        num_pages, per_page = self.runner.num_pages, self.runner.kv_bytes_per_page
        self.max_model_len = min(max_positions, num_pages * page_size)
        self.block_manager = BlockManager(num_pages, page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_batched_tokens, config.max_num_seqs
        )
        self.requests: dict[str, RequestState] = {}
        self.counters = EngineCounters()
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.masks = MaskFiller(cfg.vocab_size)
        self._next_seq_id = 0
        torch.manual_seed(config.seed)
        logger.info(
            "KV cache: %d pages x %d tokens = %d tokens (%.0f MiB, %s); max model len %d",
            num_pages,
            page_size,
            num_pages * page_size,
            num_pages * per_page / 2**20,
            str(self.kv_dtype).removeprefix("torch."),
            self.max_model_len,
        )
        # What is loaded lives as long as the engine: out of the collector's sight, a full
        # collection (~210k objects, ~50 ms with the engine thread holding the GIL) stops
        # pausing steps every few seconds. Refcounting still frees these objects.
        gc.freeze()

    @property
    def model_name(self) -> str:
        return self.source.name

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also done at exit)."""
        self.runner.shutdown()
        self.grammars.shutdown()
        self.masks.shutdown()

    def dead_reason(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel rank died), else None."""
        return self.runner.error

    # ---- requests ------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, ids

    def check_length(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The effective max_tokens; raises ValueError if the request cannot fit the context."""
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            if room < 1:
                raise ValueError(
                    f"prompt has {num_prompt_tokens} tokens, which leaves no room in this "
                    f"model's maximum context length of {self.max_model_len} tokens"
                )
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"asks for {num_prompt_tokens + params.max_tokens} ({num_prompt_tokens} in the "
                f"prompt, {params.max_tokens} for the completion)"
            )
        return params.max_tokens

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> RequestState:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        max_tokens = self.check_length(len(ids), params)
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        # The server compiled it already (off this loop); the offline API compiles it here.
        grammar = self.grammars.constraint(params.structured) if params.structured else None
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = []
        for i in range(params.n):
            seq = Sequence(
                seq_id=self._next_seq_id,
                request_id=request_id,
                index=i,
                prompt_token_ids=ids,
                params=params,
                max_tokens=max_tokens,
                arrival_time=arrival,
            )
            self._next_seq_id += 1
            if params.seed is not None:
                seq.generator = torch.Generator().manual_seed(params.seed + i)
            if grammar is not None:
                seq.constraint = grammar if i == 0 else grammar.fork()
            detokenizer.start(seq)
            seqs.append(seq)
            self.scheduler.add(seq)
        state = self.requests[request_id] = RequestState(
            request_id, text, ids, params, seqs, arrival
        )
        return state

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Abort a request; its last delta (unfinished completions end 'abort'), or None if it
        is not here."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        completions = []
        for seq in state.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                completions.append(CompletionDelta(seq.index, "", [], finish_reason="abort"))
        self._count_finish("abort", len(state.seqs))
        return RequestDelta(request_id, completions, True, self._metrics(state))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Run one batched step; what each request it touched gained (one token per sampled
        sequence: the cost is the step's size, not the outputs' length)."""
        out = self.scheduler.schedule()
        if out.empty:
            return []
        batch = out.scheduled
        sample_rows = [i for i, s in enumerate(batch) if s.samples]
        self.counters.prompt_tokens += sum(
            max(0, min(s.seq.num_prompt_tokens - s.seq.num_computed_tokens, s.num_new_tokens))
            for s in batch
        )
        seqs = [batch[i].seq for i in sample_rows]
        masks = self.masks.start(seqs)  # filled while the forward pass runs
        try:
            logits = self.runner.execute(out, sample_rows)
        except BaseException:
            # The step did not run: the rows it would have freed are freed by the next one.
            self.scheduler.unrelease(out.released)
            raise
        self.scheduler.after_step(out)
        result = sample(logits, seqs, self.eos_token_ids, masks.result() if masks else None)

        now = time.monotonic()
        touched: dict[str, list[CompletionDelta]] = {}
        dead = set(result.dead_rows)
        for row, (seq, token, logprobs) in enumerate(
            zip(seqs, result.token_ids, result.logprobs, strict=True)
        ):
            if row in dead:
                delta = self._finish(seq, SequenceStatus.FINISHED_GRAMMAR)
            else:
                delta = self._append_token(seq, token, logprobs, now)
            touched.setdefault(seq.request_id, []).append(delta)
        self.counters.generation_tokens += len(seqs)
        return [self._request_delta(rid, deltas) for rid, deltas in touched.items()]

    def _append_token(
        self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, now: float
    ) -> CompletionDelta:
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_token_ids.append(token)
        new_text = detokenizer.append_text(self._decode, seq)
        status = None
        p = seq.params
        # The mask allowed the token, so the constraint takes it unless the grammar is broken.
        if seq.constraint is not None and not seq.constraint.advance(token):
            status = SequenceStatus.FINISHED_GRAMMAR
        elif len(seq.output_token_ids) >= p.min_tokens:
            if token in p.stop_token_ids:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            elif token in self.eos_token_ids and not p.ignore_eos:
                status = SequenceStatus.FINISHED_STOPPED
            elif (stop := detokenizer.find_stop(seq, len(new_text))) is not None:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
            elif seq.constraint is not None and seq.constraint.is_complete():
                status = SequenceStatus.FINISHED_STOPPED  # only the end of output could follow
        if status is None and (
            len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(seq, status)
            self._count_finish(status.value, 1)
        return CompletionDelta(
            index=seq.index,
            text=detokenizer.take_text(seq),
            token_ids=[token],
            logprobs=[logprobs] if logprobs is not None else None,
            finish_reason=status.value if status is not None else None,
            stop_reason=seq.stop_reason,
        )

    def _finish(self, seq: Sequence, status: SequenceStatus) -> CompletionDelta:
        """End a sequence without a new token (its constraint allowed none)."""
        self.scheduler.finish(seq, status)
        self._count_finish(status.value, 1)
        return CompletionDelta(
            seq.index, detokenizer.take_text(seq), [], finish_reason=status.value
        )

    def _count_finish(self, reason: str, n: int) -> None:
        by_reason = self.counters.finished_by_reason
        by_reason[reason] = by_reason.get(reason, 0) + n

    def _request_delta(self, request_id: str, completions: list[CompletionDelta]) -> RequestDelta:
        state = self.requests[request_id]
        if len(completions) > 1:
            completions.sort(key=lambda c: c.index)
        if not state.finished:
            return RequestDelta(request_id, completions)
        del self.requests[request_id]
        return RequestDelta(request_id, completions, True, self._metrics(state))

    @staticmethod
    def _metrics(state: RequestState) -> RequestMetrics:
        first = state.seqs[0]
        return RequestMetrics(
            arrival_time=state.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min(
                (s.first_token_time for s in state.seqs if s.first_token_time), default=None
            ),
            finished_time=max((s.finished_time or 0.0 for s in state.seqs), default=None),
            num_preemptions=sum(s.num_preemptions for s in state.seqs),
            num_cached_tokens=first.num_cached_tokens,
        )

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        live = self.scheduler.running
        return EngineStats(
            num_running=len(live),
            num_waiting=len(self.scheduler.waiting),
            page_size=bm.page_size,
            kv_pages_total=bm.num_pages,
            kv_pages_used=bm.num_used_pages,
            kv_pages_cached=bm.num_cached_pages,
            kv_slots_allocated=sum(len(s.block_table) for s in live) * bm.page_size,
            kv_slots_filled=sum(s.num_computed_tokens for s in live),
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.counters.prompt_tokens,
            generation_tokens=self.counters.generation_tokens,
            prefix_cache_queries=bm.prefix_stats.queries,
            prefix_cache_hits=bm.prefix_stats.hits,
        )

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()
