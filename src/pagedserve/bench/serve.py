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
import functools
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
import numpy as np
import uvloop
from tqdm import tqdm

# The shipped prompt set lives in the repository's benchmarks/ folder (editable installs).
DEFAULT_DATASET = Path(__file__).resolve().parents[3] / "benchmarks" / "prompts.jsonl"
WARMUP_TOKENS = 4


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
    seed: int = 0
    timeout_s: float = 3600.0
    api_key: str | None = None
    warmup: bool = True
    unique_prompts: bool = True
    structured: bool = False


@dataclass
class RequestResult:
    ok: bool = False
    latency_s: float = 0.0
    ttft_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed token chunks
    error: str = ""


@dataclass
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values_s: list[float]) -> Percentiles | None:
        if not values_s:
            return None
        ms = np.asarray(values_s) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(float(ms.mean()), float(p50), float(p90), float(p99))


@dataclass
class LevelResult:
    concurrency: int
    num_prompts: int
    completed: int
    errors: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    output_throughput: float  # output tokens/s over the level's wall time
    request_throughput: float  # completed requests/s
    ttft_ms: Percentiles | None
    tpot_ms: Percentiles | None  # None without streaming: there is no per-token timing
    itl_ms: Percentiles | None
    latency_ms: Percentiles | None  # end to end, per request
    error_samples: list[str] = field(default_factory=list)


# ---- prompts --------------------------------------------------------------------------------
def load_dataset(path: str | None) -> list[str]:
    """Prompts from a JSON-lines file, one object with a "prompt" field per line."""
    p = Path(path) if path else DEFAULT_DATASET
    if not p.is_file():
        raise ValueError(f"dataset {str(p)!r} not found (pass --dataset FILE.jsonl)")
    prompts = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{p}:{n}: expected a JSON object with a 'prompt'") from None
    if not prompts:
        raise ValueError(f"dataset {str(p)!r} holds no prompts")
    return prompts


def _word_tokens(tokenizer: Any) -> list[str]:
    """Vocabulary entries ' word' that encode back to exactly one token.

    Joined together, such pieces tokenize to exactly one token each (the pre-tokenizer splits at
    the spaces), so a synthetic prompt of L pieces is L tokens long.
    """
    ids = list(range(len(tokenizer)))
    special = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in ids])
    cands = [
        (i, t)
        for i, t in zip(ids, texts, strict=True)
        if i not in special and len(t) > 2 and t[0] == " " and t[1:].isascii() and t[1:].isalpha()
    ]
    encoded = tokenizer([t for _, t in cands], add_special_tokens=False)["input_ids"]
    words = [t for (i, t), enc in zip(cands, encoded, strict=True) if enc == [i]]
    if len(words) < 100:
        raise ValueError("the tokenizer has too few single-token words for synthetic prompts")
    return words


@functools.lru_cache(maxsize=2)
def tokenizer_words(tokenizer_path: str | None) -> tuple[Any, list[str]]:
    """The tokenizer (None: the default model's) and its single-token words; slow, so cached."""
    from pagedserve.models.loader import ModelSource, load_tokenizer

    tokenizer = load_tokenizer(ModelSource.resolve(tokenizer_path))
    return tokenizer, _word_tokens(tokenizer)


def synthetic_prompts(n: int, input_len: int, seed: int, tokenizer_path: str | None) -> list[str]:
    if input_len < 1:
        raise ValueError("--synthetic-input-len must be >= 1")
    _, words = tokenizer_words(tokenizer_path)
    rng = random.Random(seed)
    return ["".join(rng.choices(words, k=input_len)) for _ in range(n)]


def select_prompts(cfg: BenchConfig) -> list[str]:
    """num_prompts prompts, the same for every level and every server given the same seed."""
    if cfg.synthetic_input_len is not None:
        return synthetic_prompts(cfg.num_prompts, cfg.synthetic_input_len, cfg.seed, cfg.tokenizer)
    pool = load_dataset(cfg.dataset)
    random.Random(cfg.seed).shuffle(pool)  # a prefix of the file would skew the lengths
    return [pool[i % len(pool)] for i in range(cfg.num_prompts)]


def tag_prompt(prompt: str, tag: str, cfg: BenchConfig) -> str:
    """The prompt behind a marker unique to this run, level and request.

    The same prompts are sent at every level (and by every run against the same server): a
    server with a prefix cache would then skip their prefill after the first level, which no
    real workload gives it. A distinct first line makes every prompt's first KV page unique.
    """
    return f"[{tag}]\n{prompt}" if cfg.unique_prompts else prompt


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
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    return body


# What a failed request raises: connection and protocol errors, timeouts, a malformed body.
_REQUEST_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ValueError)


def _error_text(resp: aiohttp.ClientResponse, body: bytes) -> str:
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body[:200].decode("utf-8", "replace")
    return f"HTTP {resp.status}: {msg}"


async def send_streaming(client: aiohttp.ClientSession, url: str, body: dict) -> RequestResult:
    res = RequestResult()
    start = last = time.perf_counter()
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = _error_text(resp, await resp.read())
                return res
            async for line in resp.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                msg = json.loads(data)
                if "error" in msg:  # an error after the stream started is reported in-band
                    err = msg["error"]
                    res.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    return res
                choices = msg.get("choices") or []
                # A chunk with a token: text, or no finish_reason (a token of a partial UTF-8
                # character has empty text). An empty chunk carrying only finish_reason isn't.
                if choices and (choices[0].get("text") or not choices[0].get("finish_reason")):
                    if chunks == 0:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    chunks += 1
                if usage := msg.get("usage"):
                    usage_tokens = usage.get("completion_tokens")
                    res.prompt_tokens = usage.get("prompt_tokens")
    except _REQUEST_ERRORS as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency_s = time.perf_counter() - start
    # The server's own count when it sends usage; one token per chunk otherwise.
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    res.ok = True
    return res


async def send_plain(client: aiohttp.ClientSession, url: str, body: dict) -> RequestResult:
    res = RequestResult()
    start = time.perf_counter()
    try:
        async with client.post(url, json=body) as resp:
            content = await resp.read()
        res.latency_s = res.ttft_s = time.perf_counter() - start  # nothing arrives earlier
        if resp.status != 200:
            res.error = _error_text(resp, content)
            return res
        usage = json.loads(content).get("usage") or {}
    except _REQUEST_ERRORS as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if usage.get("completion_tokens") is None:
        res.error = "the response has no usage.completion_tokens to count output tokens"
        return res
    res.output_tokens = int(usage["completion_tokens"])
    res.prompt_tokens = usage.get("prompt_tokens")
    res.ok = True
    return res


# ---- one concurrency level ------------------------------------------------------------------
def summarize(
    concurrency: int, results: list[RequestResult], duration_s: float, stream: bool
) -> LevelResult:
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return LevelResult(
        concurrency=concurrency,
        num_prompts=len(results),
        completed=len(good),
        errors=len(errors),
        duration_s=duration_s,
        input_tokens=sum(r.prompt_tokens or 0 for r in good),
        output_tokens=out_tokens,
        output_throughput=out_tokens / duration_s if duration_s > 0 else 0.0,
        request_throughput=len(good) / duration_s if duration_s > 0 else 0.0,
        ttft_ms=Percentiles.of([r.ttft_s for r in good]),
        tpot_ms=Percentiles.of(tpot) if stream else None,
        itl_ms=Percentiles.of([x for r in good for x in r.itl_s]) if stream else None,
        latency_ms=Percentiles.of([r.latency_s for r in good]),
        error_samples=sorted(set(errors))[:5],
    )


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


async def fetch_model(client: aiohttp.ClientSession, root: str) -> str:
    try:
        async with client.get(f"{root}/v1/models", raise_for_status=True) as resp:
            return str(json.loads(await resp.read())["data"][0]["id"])
    except (*_REQUEST_ERRORS, KeyError, IndexError) as e:
        msg = f"cannot read a model id from {root}/v1/models ({e}); pass --model"
        raise ValueError(msg) from None


async def run_benchmark(
    cfg: BenchConfig,
    prompts: list[str],
    show_progress: bool = True,
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
                _payload(cfg, model, tag_prompt(p, f"{nonce}-{level}-{i}", cfg), cfg.max_tokens)
                for i, p in enumerate(prompts)
            ]
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
            levels.append(summarize(c, results, duration, cfg.stream))
    return model, levels


# ---- output ---------------------------------------------------------------------------------
def _pct(p: Percentiles | dict | None) -> str:
    if p is None:
        return "-"
    d = dataclasses.asdict(p) if isinstance(p, Percentiles) else p
    return f"{d['p50']:.0f} / {d['p90']:.0f} / {d['p99']:.0f}"


def format_table(levels: list[LevelResult] | list[dict]) -> str:
    """A Markdown table of the levels (results or their JSON form)."""
    rows = [
        "| concurrency | completed | errors | duration (s) | output tok/s | req/s "
        "| TTFT p50/p90/p99 (ms) | TPOT p50/p90/p99 (ms) | ITL p50/p90/p99 (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in levels:
        d = dataclasses.asdict(lv) if isinstance(lv, LevelResult) else lv
        rows.append(
            f"| {d['concurrency']} | {d['completed']}/{d['num_prompts']} | {d['errors']} "
            f"| {d['duration_s']:.1f} | {d['output_throughput']:.1f} "
            f"| {d['request_throughput']:.2f} | {_pct(d['ttft_ms'])} | {_pct(d['tpot_ms'])} "
            f"| {_pct(d['itl_ms'])} |"
        )
    return "\n".join(rows)


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


def plot(series: dict[str, list[dict]], path: str, title: str = "") -> None:
    """Output tokens/s and latency against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    ticks = sorted({lv["concurrency"] for levels in series.values() for lv in levels})
    for i, (name, levels) in enumerate(series.items()):
        color = f"C{i}"
        xs = [lv["concurrency"] for lv in levels]
        ax_tp.plot(xs, [lv["output_throughput"] for lv in levels], "o-", color=color, label=name)
        ttft = [lv["ttft_ms"]["p50"] if lv["ttft_ms"] else math.nan for lv in levels]
        streamed = any(lv["tpot_ms"] for lv in levels)
        label = f"{name} TTFT p50" if streamed else f"{name} latency p50 (not streamed)"
        ax_lat.plot(xs, ttft, "o-", color=color, label=label)
        if streamed:
            tpot = [lv["tpot_ms"]["p50"] if lv["tpot_ms"] else math.nan for lv in levels]
            ax_lat.plot(xs, tpot, "s--", color=color, label=f"{name} TPOT p50")
    for ax in (ax_tp, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_tp.set_ylabel("output tokens/s")
    ax_tp.set_ylim(bottom=0)
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.set_yscale("log")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if not args.concurrency or min(args.concurrency) < 1:
        raise ValueError("--concurrency takes positive integers, e.g. 1,8,32")
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--num-prompts and --max-tokens must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf: closed loop)")
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
        seed=args.seed,
        timeout_s=args.timeout,
        api_key=args.api_key,
        warmup=args.warmup,
        unique_prompts=args.unique_prompts,
        structured=args.structured,
    )


def run_serve_bench(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    prompts = select_prompts(cfg)
    # uvloop, as the server: the client shares the machine with the server it measures
    # (c=32 on 2 cores: ~0.15 s less client CPU a level than asyncio's default loop).
    model, levels = uvloop.run(run_benchmark(cfg, prompts))
    loop = "closed loop" if math.isinf(cfg.request_rate) else f"Poisson {cfg.request_rate}/s"
    print(
        f"{cfg.base_url} model {model}: {cfg.num_prompts} prompts x {cfg.max_tokens} output "
        f"tokens per level, {loop}, {'streaming' if cfg.stream else 'not streaming'}"
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
