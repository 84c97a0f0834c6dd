"""One `bench serve` request against /v1/completions, streamed (every token timed) or not."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestResult:
    ok: bool = False
    latency_s: float = 0.0
    ttft_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed token chunks
    error: str = ""


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


_SAMPLE = re.compile(r"([a-zA-Z_:][\w:]*)(?:\{.*\})? (\S+)")
_PREFIX_COUNTERS = ("pagedserve_prefix_cache_hits_total", "pagedserve_prefix_cache_queries_total")


async def prefix_cache_counters(
    client: aiohttp.ClientSession, root: str
) -> tuple[float, float] | None:
    """The server's prefix-cache hit and query counters (tokens), summed over every series
    (every replica of a data-parallel server); None where /metrics has no such series."""
    try:
        async with client.get(f"{root}/metrics") as resp:
            text = (await resp.read()).decode() if resp.status == 200 else ""
    except _REQUEST_ERRORS:
        return None
    sums = dict.fromkeys(_PREFIX_COUNTERS, 0.0)
    found = False
    for line in text.splitlines():
        m = _SAMPLE.fullmatch(line)
        if m and m.group(1) in sums:
            sums[m.group(1)] += float(m.group(2))
            found = True
    return (sums[_PREFIX_COUNTERS[0]], sums[_PREFIX_COUNTERS[1]]) if found else None


def hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Prompt tokens found in the prefix cache over those looked up, between two readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


async def fetch_model(client: aiohttp.ClientSession, root: str) -> str:
    try:
        async with client.get(f"{root}/v1/models", raise_for_status=True) as resp:
            return str(json.loads(await resp.read())["data"][0]["id"])
    except (*_REQUEST_ERRORS, KeyError, IndexError) as e:
        msg = f"cannot read a model id from {root}/v1/models ({e}); pass --model"
        raise ValueError(msg) from None
