"""`pagedserve bench serve`: a load generator against any OpenAI-compatible /v1/completions.

In the manner of vLLM's benchmark_serving: for each concurrency level, either a closed loop (N
workers, each sending the next prompt as soon as its previous one finished) or, with a finite
--request-rate, an open loop of Poisson arrivals capped at that many requests in flight. Requests
stream (SSE) so that every token can be timed: time to first token (TTFT), time per output token
after the first (TPOT) and the gaps between streamed chunks (inter-token latency, ITL).
With --structured every request is constrained to a JSON schema of its own (vLLM's
structured_outputs), to compare constrained decoding with the same prompts unconstrained.

One asyncio loop and one aiohttp connection pool (the client of vLLM's benchmark too): on a
machine whose cores also run the server, the client must cost little CPU, or it lowers what it
measures. Against httpx, aiohttp cut a minimal client's CPU for a c=32 run of 64 x 128 tokens
from 0.75 to 0.28 s, and this benchmark measured pagedserve ~4% faster at c=32 on 2 cores
(alternating runs against one server).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from tqdm import tqdm

from pagedserve.bench.serve_client import (
    RequestResult,
    fetch_model,
    hit_rate,
    prefix_cache_counters,
    send_plain,
    send_streaming,
)
from pagedserve.bench.serve_prompts import load_dataset, synthetic_prompts
from pagedserve.bench.serve_report import LevelResult, format_table, plot, summarize

WARMUP_TOKENS = 4
# Before reading a level's closing prefix-cache counters: a data-parallel server's replicas
# push theirs to its /metrics every second.
METRICS_SETTLE_S = 1.5


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    num_prompts: int = 64
    max_tokens: int = 128
    request_rate: float = math.inf  # inf: closed loop; else Poisson arrivals per second
    dataset: str | None = None
    synthetic_input_len: int | None = None
    tokenizer: str | None = None  # for synthetic prompts; None: the default model's
    stream: bool = True
    ignore_eos: bool = True
    min_tokens: bool = False  # also send min_tokens = max_tokens (llama.cpp ignores ignore_eos)
    seed: int = 0
    timeout_s: float = 3600.0
    api_key: str | None = None
    warmup: bool = True
    unique_prompts: bool = True
    shared_prefixes: int = 0  # K > 0: K long system prompts, requests interleaved over them
    prefix_len: int = 512  # tokens of each shared system prompt
    structured: bool = False


# ---- prompts --------------------------------------------------------------------------------
def select_prompts(cfg: BenchConfig) -> list[str]:
    """num_prompts prompts, the same for every level and every server given the same seed."""
    if cfg.synthetic_input_len is not None:
        return synthetic_prompts(cfg.num_prompts, cfg.synthetic_input_len, cfg.seed, cfg.tokenizer)
    pool = load_dataset(cfg.dataset)
    random.Random(cfg.seed).shuffle(pool)  # a prefix of the file would skew the lengths
    return [pool[i % len(pool)] for i in range(cfg.num_prompts)]


def select_prefixes(cfg: BenchConfig) -> list[str]:
    """The shared-prefix workload's system prompts (none unless --shared-prefixes)."""
    if cfg.shared_prefixes < 1:
        return []
    return synthetic_prompts(cfg.shared_prefixes, cfg.prefix_len, cfg.seed + 1, cfg.tokenizer)


def tag_prompt(prompt: str, tag: str, cfg: BenchConfig) -> str:
    """The prompt behind a marker unique to this run, level and request.

    The same prompts are sent at every level (and by every run against the same server): a
    server with a prefix cache would then skip their prefill after the first level, which no
    real workload gives it. A distinct first line makes every prompt's first KV page unique.
    """
    return f"[{tag}]\n{prompt}" if cfg.unique_prompts else prompt


def level_prompts(cfg: BenchConfig, prompts: list[str], prefixes: list[str], tag: str) -> list[str]:
    """One level's prompts. With shared prefixes, request i continues system prompt i mod K
    (interleaved, as many users of a few applications arrive), the prompt's marker unique to
    the run, level and system prompt: each level reuses nothing of the levels before it."""
    if not prefixes:
        return [tag_prompt(p, f"{tag}-{i}", cfg) for i, p in enumerate(prompts)]
    k = len(prefixes)
    return [
        tag_prompt(f"{prefixes[i % k]}\n{p}", f"{tag}-p{i % k}", cfg) for i, p in enumerate(prompts)
    ]


# ---- one request ----------------------------------------------------------------------------
def request_schema(i: int) -> dict[str, Any]:
    """Request i's JSON schema: distinct per request (each is compiled once), and long (64
    notes at least), so that constrained outputs run to max_tokens like unconstrained ones."""
    return {
        "type": "object",
        "properties": {
            "id": {"const": i},
            "topic": {"type": "string", "maxLength": 40},
            "notes": {"type": "array", "items": {"type": "string"}, "minItems": 64},
        },
        "required": ["id", "topic", "notes"],
        "additionalProperties": False,
    }


def _payload(cfg: BenchConfig, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": cfg.stream,
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extra; servers without it produce varying lengths
    if cfg.min_tokens:
        body["min_tokens"] = max_tokens
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    return body


# ---- one concurrency level ------------------------------------------------------------------
Sender = Callable[[dict], Awaitable[RequestResult]]


async def run_level(
    send: Sender,
    bodies: list[dict],
    concurrency: int,
    request_rate: float,
    seed: int,
    progress: tqdm | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every body; the results and the wall time from the first send to the last answer."""
    results: list[RequestResult] = []

    async def one(body: dict) -> None:
        results.append(await send(body))
        if progress is not None:
            progress.update(1)

    start = time.perf_counter()
    if math.isinf(request_rate):
        pending = iter(bodies)  # shared: each worker takes the next prompt when it is free

        async def worker() -> None:
            for body in pending:
                await one(body)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
    else:
        gate = asyncio.Semaphore(concurrency)
        rng = random.Random(seed)

        async def gated(body: dict) -> None:
            async with gate:
                await one(body)

        tasks = []
        for i, body in enumerate(bodies):
            if i:
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(gated(body)))
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


# ---- the whole run --------------------------------------------------------------------------
def api_root(base_url: str) -> str:
    """Accept http://host:port, with or without a trailing /v1."""
    return base_url.rstrip("/").removesuffix("/v1")


async def run_benchmark(
    cfg: BenchConfig,
    prompts: list[str],
    show_progress: bool = True,
    prefixes: list[str] | None = None,
) -> tuple[str, list[LevelResult]]:
    """The model id used and one result per concurrency level, in order."""
    root = api_root(cfg.base_url)
    url = f"{root}/v1/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    connector = aiohttp.TCPConnector(limit=max(cfg.concurrency))
    # Read timeout is per chunk: a queued request may wait minutes for its first byte.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=cfg.timeout_s)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as client:
        model = cfg.model or await fetch_model(client, root)
        sender = send_streaming if cfg.stream else send_plain

        async def send(body: dict) -> RequestResult:
            return await sender(client, url, body)

        if cfg.warmup:  # first-request costs (lazy init, caches) stay out of the figures
            warm_prompt = tag_prompt(prompts[0], f"{secrets.token_hex(3)}-warmup", cfg)
            warm = await send(_payload(cfg, model, warm_prompt, min(WARMUP_TOKENS, cfg.max_tokens)))
            if not warm.ok:
                raise ValueError(f"warm-up request to {url} failed: {warm.error}")
        nonce = secrets.token_hex(3)
        levels = []
        for level, c in enumerate(cfg.concurrency):
            bodies = [
                _payload(cfg, model, p, cfg.max_tokens)
                for p in level_prompts(cfg, prompts, prefixes or [], f"{nonce}-{level}")
            ]
            counters = await prefix_cache_counters(client, root) if prefixes else None
            if cfg.structured:
                for i, body in enumerate(bodies):
                    schema = request_schema(level * len(bodies) + i)
                    body["structured_outputs"] = {"json": schema}
            with tqdm(
                total=len(bodies),
                desc=f"concurrency {c}",
                unit="req",
                disable=not show_progress,
                mininterval=1.0,
                file=sys.stderr,
            ) as bar:
                results, duration = await run_level(
                    send, bodies, c, cfg.request_rate, cfg.seed, bar
                )
            result = summarize(c, results, duration, cfg.stream)
            if counters is not None:
                await asyncio.sleep(METRICS_SETTLE_S)
                result.prefix_hit_rate = hit_rate(
                    counters, await prefix_cache_counters(client, root)
                )
            levels.append(result)
    return model, levels


# ---- output ---------------------------------------------------------------------------------
def results_json(cfg: BenchConfig, model: str, levels: list[LevelResult]) -> dict[str, Any]:
    config = dataclasses.asdict(cfg)
    config.pop("api_key")
    if math.isinf(cfg.request_rate):
        config["request_rate"] = "inf"  # JSON has no infinity
    return {
        "base_url": cfg.base_url,
        "model": model,
        "config": config,
        "levels": [dataclasses.asdict(lv) for lv in levels],
    }


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if not args.concurrency or min(args.concurrency) < 1:
        raise ValueError("--concurrency takes positive integers, e.g. 1,8,32")
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--num-prompts and --max-tokens must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf: closed loop)")
    if args.shared_prefixes < 0 or args.prefix_len < 1:
        raise ValueError("--shared-prefixes must be >= 0 and --prefix-len >= 1")
    return BenchConfig(
        base_url=args.base_url,
        model=args.model,
        concurrency=args.concurrency,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        request_rate=args.request_rate,
        dataset=args.dataset,
        synthetic_input_len=args.synthetic_input_len,
        tokenizer=args.tokenizer,
        stream=args.stream,
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        seed=args.seed,
        timeout_s=args.timeout,
        api_key=args.api_key,
        warmup=args.warmup,
        unique_prompts=args.unique_prompts,
        shared_prefixes=args.shared_prefixes,
        prefix_len=args.prefix_len,
        structured=args.structured,
    )


def run_serve_bench(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    prompts = select_prompts(cfg)
    prefixes = select_prefixes(cfg)
    # uvloop, as the server: the client shares the machine with the server it measures
    # (c=32 on 2 cores: ~0.15 s less client CPU a level than asyncio's default loop).
    model, levels = uvloop.run(run_benchmark(cfg, prompts, prefixes=prefixes))
    loop = "closed loop" if math.isinf(cfg.request_rate) else f"Poisson {cfg.request_rate}/s"
    shared = (
        f", {cfg.shared_prefixes} shared system prompts of {cfg.prefix_len} tokens"
        if prefixes
        else ""
    )
    print(
        f"{cfg.base_url} model {model}: {cfg.num_prompts} prompts x {cfg.max_tokens} output "
        f"tokens per level, {loop}, {'streaming' if cfg.stream else 'not streaming'}{shared}"
    )
    print(format_table(levels))
    for lv in levels:
        for e in lv.error_samples:
            print(f"concurrency {lv.concurrency} error: {e}", file=sys.stderr)
    data = results_json(cfg, model, levels)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    if args.plot:
        plot({model: data["levels"]}, args.plot, title=f"{model} at {cfg.base_url}")
    return 1 if any(lv.errors for lv in levels) else 0
