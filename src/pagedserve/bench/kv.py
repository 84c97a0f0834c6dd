"""KV-cache benchmarks, in process on the engine.

`bench prefix`: 32 requests sharing one long system prompt, prefix caching on against off.
`bench capacity`: how many sequences one KV budget holds at once with paging, against a
contiguous allocation of max-model-len per sequence, and the slots paging leaves unfilled.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from pagedserve.bench.prompts import TOPICS, benchmark_prompts
from pagedserve.config import EngineConfig
from pagedserve.engine import LLMEngine
from pagedserve.sampling_params import SamplingParams

SYSTEM_PARAGRAPH = (
    "You are the help desk of a large public library. Visitors ask about opening hours, "
    "borrowing limits, renewals, late fees, lost cards, the reading rooms, the map archive, "
    "interlibrary loans, printing, accessibility services and events for children. Answer in "
    "two or three sentences, politely, and point to the right desk when unsure. "
)


def shared_prefix_prompts(engine: LLMEngine, prefix_tokens: int, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    system = tok.encode(SYSTEM_PARAGRAPH * (prefix_tokens // 50 + 1))[:prefix_tokens]
    return [
        system + tok.encode(f" Question {i}: tell me about {TOPICS[i % 16]}.") for i in range(n)
    ]


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Submit every prompt at once, step to completion; time to first token per request."""
    start = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, arrival_time=start)
    ttft = []
    peak_running, waste = 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
        s = engine.stats()
        peak_running = max(peak_running, s.num_running)
        if s.kv_slots_allocated:
            waste.append(s.kv_waste)
    return {
        "total_s": time.monotonic() - start,
        "ttft_p50_s": statistics.median(ttft),
        "peak_running": peak_running,
        "mean_waste": statistics.fmean(waste) if waste else 0.0,
    }


def _engine(args: argparse.Namespace, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, **overrides))


def run_prefix_bench(args: argparse.Namespace) -> int:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    for caching in (False, True):
        engine = _engine(args, enable_prefix_caching=caching, kv_cache_memory=args.kv_cache_memory)
        prompts = shared_prefix_prompts(engine, args.prefix_tokens, args.num_prompts)
        run_all(engine, prompts[:1], SamplingParams(max_tokens=2))  # warm-up
        engine.reset_prefix_cache()
        results[caching] = run_all(engine, prompts, params)
        stats = engine.stats()
        results[caching]["hit_rate"] = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
        del engine
        gc.collect()
    off, on = results[False], results[True]
    lines = [
        f"{args.num_prompts} requests sharing a {args.prefix_tokens}-token system prompt, "
        f"{args.max_tokens} output tokens each, all submitted at once ({args.dtype})",
        "",
        "| prefix caching | TTFT p50 (s) | total (s) | prefix hit rate |",
        "|---|---|---|---|",
        f"| off | {off['ttft_p50_s']:.2f} | {off['total_s']:.2f} | {off['hit_rate']:.0%} |",
        f"| on | {on['ttft_p50_s']:.2f} | {on['total_s']:.2f} | {on['hit_rate']:.0%} |",
        "",
        f"TTFT p50 {off['ttft_p50_s'] / on['ttft_p50_s']:.1f}x lower, "
        f"total time {off['total_s'] / on['total_s']:.1f}x lower with caching.",
    ]
    print("\n".join(lines))
    return 0


def run_capacity_bench(args: argparse.Namespace) -> int:
    engine = _engine(
        args,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=1024,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    result = run_all(engine, benchmark_prompts(args.num_prompts), params)
    pool_tokens = engine.block_manager.num_pages * engine.block_manager.page_size
    contiguous = pool_tokens // engine.max_model_len
    lines = [
        f"KV budget {args.kv_cache_memory} = {pool_tokens} tokens, max model len "
        f"{engine.max_model_len}, {args.num_prompts} requests x {args.max_tokens} output tokens",
        "",
        "| allocation | sequences held at once |",
        "|---|---|",
        f"| contiguous, max-model-len per sequence | {contiguous} |",
        f"| paged ({engine.block_manager.page_size}-token pages) | {result['peak_running']} |",
        "",
        f"Paging holds {result['peak_running'] / max(contiguous, 1):.1f}x the sequences "
        f"({engine.scheduler.num_preemptions} preemptions); allocated but unfilled slots "
        f"average {result['mean_waste']:.1%} of the slots in use.",
    ]
    print("\n".join(lines))
    return 0
