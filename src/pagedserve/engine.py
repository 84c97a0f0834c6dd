"""The engine: requests in, one batched model step at a time, outputs back.

It owns the tokenizer, the scheduler, the block manager, the model runner and the sampler,
and knows nothing of HTTP. `step()` is called in a loop by the offline `LLM` or by the async
engine's thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedserve import detokenizer
from pagedserve.attention import get_backend
from pagedserve.block_manager import BlockManager
from pagedserve.config import EngineConfig
from pagedserve.cpu_kernels import isa
from pagedserve.distributed.sharding import ShardPlan
from pagedserve.model_runner import ModelRunner, kv_bytes_per_page
from pagedserve.models.config import ModelConfig
from pagedserve.models.loader import ModelSource, load_config, load_model, load_tokenizer
from pagedserve.models.quant_weight import packed_kernels_available
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.sampler import sample
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler
from pagedserve.sequence import Sequence, SequenceStatus
from pagedserve.structured.compiler import GrammarCompiler
from pagedserve.structured.masks import MaskFiller

if TYPE_CHECKING:
    from pagedserve.distributed.executor import TensorParallelExecutor

logger = logging.getLogger(__name__)

# The pool is calloc'd, so only touched pages are resident; but prefix caching keeps freed
# pages' contents and hands out untouched pages first, so under sustained load the whole pool
# becomes resident. 512 MiB (23,296 tokens of the default model: 64 sequences of ~360 tokens)
# keeps the default model's server under 1.5 GB resident.
CPU_DEFAULT_KV_BYTES = 512 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def kv_budget_bytes(
    config: EngineConfig,
    model: torch.nn.Module,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Bytes for KV pages on `device`, after the model's weights (a rank's shard under TP)."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    # Free memory after the weights, less headroom for activations of a full step.
    torch.cuda.synchronize()
    total = torch.cuda.get_device_properties(device).total_memory
    activation_headroom = _profile_peak_activation_bytes(config, model, cfg, dtype, device)
    budget = total * config.gpu_memory_utilization
    return int(budget - torch.cuda.memory_allocated() - activation_headroom)


def _profile_peak_activation_bytes(
    config: EngineConfig,
    model: torch.nn.Module,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Peak extra memory of a forward at the full token budget (no KV pages yet)."""
    n = config.max_num_batched_tokens
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.inference_mode():
        x = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        for layer in model.layers:
            x = layer.mlp(layer.post_attention_layernorm(x))
        model.compute_logits(x[-min(n, config.max_num_seqs) :])
    return torch.cuda.max_memory_allocated() - before


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA, and on a CPU whose kernel level computes it natively (see README
    "dtype on CPU"), float32 on other CPUs. An explicit bfloat16 that this CPU would only emulate
    is refused here, before anything loads (oneDNN's bf16 layouts refuse it mid-load)."""
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


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = _pick_device(config.device)
        self.dtype = _pick_dtype(config.dtype, self.device)
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
        self.backend = get_backend(config.attention_backend, self.device)
        max_positions = config.max_model_len or cfg.max_context
        keep_quant = (
            config.quantization == "auto"
            and self.dtype == torch.bfloat16
            and self.device.type == "cpu"
            and self.source.kind == "gguf"
            and packed_kernels_available()
        )
        page_size = config.block_size
        self.runner: ModelRunner | TensorParallelExecutor
        if config.tensor_parallel_size > 1:
            from pagedserve.distributed.executor import RankSpec, TensorParallelExecutor

            # Rank 0 runs in this process, the others in workers; each holds only its shard.
            self.model = None
            spec = RankSpec(
                config, self.source, cfg, self.dtype, self.device.type, max_positions, keep_quant
            )
            self.runner = TensorParallelExecutor(spec)
            num_pages, per_page = self.runner.num_pages, self.runner.kv_bytes_per_page
        else:
            self.model = load_model(
                self.source, cfg, self.backend, self.dtype, self.device, max_positions, keep_quant
            )
            per_page = kv_bytes_per_page(cfg, page_size, self.dtype)
            budget = kv_budget_bytes(config, self.model, cfg, self.dtype, self.device)
            num_pages = budget // per_page
            if num_pages < 1:
                raise ValueError("kv_cache_memory is too small for a single KV page")
            self.runner = ModelRunner(
                self.model, cfg, self.backend, num_pages, page_size, self.dtype, self.device
            )
        self.max_model_len = min(max_positions, num_pages * page_size)
        self.block_manager = BlockManager(num_pages, page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_batched_tokens, config.max_num_seqs
        )
        self.requests: dict[str, RequestState] = {}
        self.counters = EngineCounters()
        vocab = cfg.vocab_size
        self.grammars = GrammarCompiler(self.tokenizer, vocab, self.eos_token_ids)
        self.masks = MaskFiller(vocab)
        self._next_seq_id = 0
        torch.manual_seed(config.seed)
        logger.info(
            "KV cache: %d pages x %d tokens = %d tokens (%.0f MiB, %s); max model len %d",
            num_pages,
            page_size,
            num_pages * page_size,
            num_pages * per_page / 2**20,
            str(self.dtype).removeprefix("torch."),
            self.max_model_len,
        )

    @property
    def model_name(self) -> str:
        return self.source.name

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also done at exit)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()
        self.grammars.shutdown()
        self.masks.shutdown()

    def dead_reason(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel rank died), else None."""
        return getattr(self.runner, "error", None)

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
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        max_tokens = self.check_length(len(ids), params)
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        # The server compiled it already (off this loop); the offline API compiles it here.
        grammar = self.grammars.compile(params.structured) if params.structured else None
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
                seq.grammar = grammar if i == 0 else grammar.deep_copy()
            detokenizer.start(seq)
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = RequestState(request_id, text, ids, params, seqs, arrival)

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        for seq in state.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._count_finish("abort", len(state.seqs))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.empty:
            return []
        # Single-token rows (decodes) first: the attention metadata expects that layout.
        batch = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        sample_rows = [i for i, s in enumerate(batch) if s.samples]
        self.counters.prompt_tokens += sum(
            max(0, min(s.seq.num_prompt_tokens - s.seq.num_computed_tokens, s.num_new_tokens))
            for s in batch
        )
        seqs = [batch[i].seq for i in sample_rows]
        masks = self.masks.start(seqs)  # filled while the forward pass runs
        logits = self.runner.execute(batch, sample_rows)
        self.scheduler.after_step(out)
        result = sample(logits, seqs, self.eos_token_ids, masks.result() if masks else None)

        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        dead = set(result.dead_rows)
        for row, (seq, token, logprobs) in enumerate(
            zip(seqs, result.token_ids, result.logprobs, strict=True)
        ):
            if row in dead:
                self._finish(seq, SequenceStatus.FINISHED_GRAMMAR)
            else:
                self._append_token(seq, token, logprobs, now)
            touched[seq.request_id] = self.requests[seq.request_id]
        self.counters.generation_tokens += len(seqs)
        return [self._make_output(state) for state in touched.values()]

    def _append_token(self, seq: Sequence, token: int, logprobs, now: float) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        new_text = detokenizer.append_text(self._decode, seq)
        status = None
        p = seq.params
        # The mask allowed the token, so the matcher takes it unless the grammar is broken.
        if seq.grammar is not None and not seq.grammar.consume_token(token):
            status = SequenceStatus.FINISHED_GRAMMAR
        elif len(seq.output_token_ids) >= p.min_tokens:
            if token in p.stop_token_ids:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            elif token in self.eos_token_ids and not p.ignore_eos:
                status = SequenceStatus.FINISHED_STOPPED
            elif (stop := detokenizer.find_stop(seq, len(new_text))) is not None:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
            elif seq.grammar is not None and seq.grammar.is_stopped():
                status = SequenceStatus.FINISHED_STOPPED  # complete: only EOS could follow
        if status is None and (
            len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(seq, status)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)
        self._count_finish(status.value, 1)

    def _count_finish(self, reason: str, n: int) -> None:
        by_reason = self.counters.finished_by_reason
        by_reason[reason] = by_reason.get(reason, 0) + n

    def _make_output(self, state: RequestState) -> RequestOutput:
        outputs = []
        for seq in state.seqs:
            text = detokenizer.visible_text(seq)
            seq.emitted_text_len = len(text)
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.status.value if seq.finished else None,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                )
            )
        finished = state.finished
        if finished:
            del self.requests[state.request_id]
        first = state.seqs[0]
        metrics = RequestMetrics(
            arrival_time=state.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min(
                (s.first_token_time for s in state.seqs if s.first_token_time), default=None
            ),
            finished_time=max((s.finished_time or 0.0 for s in state.seqs), default=None),
            num_preemptions=sum(s.num_preemptions for s in state.seqs),
            num_cached_tokens=first.num_cached_tokens,
        )
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, outputs, finished, metrics
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
