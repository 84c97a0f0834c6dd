"""`pagedserve bench serve`: its timing and counting against scripted fake servers (aiohttp
servers on a local port, no model), then end to end against a real `pagedserve serve`
subprocess."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from pagedserve.bench.serve import BenchConfig, results_json, run_benchmark
from pagedserve.bench.serve_prompts import (
    DEFAULT_DATASET,
    load_dataset,
    synthetic_prompts,
    tokenizer_words,
)
from pagedserve.bench.serve_report import format_table

PROMPTS = ["one", "two", "three", "four", "five", "six"]


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


class FakeServer:
    """A scripted /v1/completions: `tokens` chunks `gap_s` apart, optional usage, or errors."""

    def __init__(
        self,
        tokens: int = 4,
        gap_s: float = 0.01,
        usage: bool = True,
        fail_every: int = 0,
        finish_chunk: bool = False,
    ):
        self.tokens, self.gap_s, self.usage = tokens, gap_s, usage
        self.fail_every, self.finish_chunk = fail_every, finish_chunk
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        n = min(self.tokens, body["max_tokens"])
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if not body["stream"]:
                await asyncio.sleep(self.gap_s * n)
                usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
                choice = {"index": 0, "text": "x" * n, "finish_reason": "length"}
                return web.json_response({"choices": [choice], "usage": usage})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(n):
                await asyncio.sleep(self.gap_s)
                last = i == n - 1 and not self.finish_chunk
                finish = "length" if last else None
                choice = {"index": 0, "text": f" t{i}", "finish_reason": finish}
                await resp.write(_sse({"choices": [choice], "usage": None}))
            if self.finish_chunk:  # vLLM-style: an empty chunk carrying only finish_reason
                choice = {"index": 0, "text": "", "finish_reason": "length"}
                await resp.write(_sse({"choices": [choice]}))
            if self.usage and body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
                await resp.write(_sse({"choices": [], "usage": usage}))
        finally:
            # Before [DONE]: a client may close the connection as soon as it reads it.
            self.in_flight -= 1
        await resp.write(_sse("[DONE]"))
        await resp.write_eof()
        return resp


async def _serve_and_bench(fake: FakeServer, prefixes: list[str] | None = None, **cfg_kw):
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/v1/completions", fake.completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        cfg = BenchConfig(base_url=f"http://{host}:{port}", **cfg_kw)
        return cfg, await run_benchmark(cfg, PROMPTS, show_progress=False, prefixes=prefixes)
    finally:
        await runner.cleanup()


def run_fake(fake: FakeServer, prefixes: list[str] | None = None, **cfg_kw):
    return asyncio.run(_serve_and_bench(fake, prefixes, **cfg_kw))[1]


def test_streaming_counts_and_times_tokens():
    fake = FakeServer(tokens=5, gap_s=0.02)
    model, levels = run_fake(fake, concurrency=[1, 3], max_tokens=8)
    assert model == "fake-model"
    assert [lv.concurrency for lv in levels] == [1, 3]
    for lv in levels:
        assert (lv.completed, lv.errors, lv.num_prompts) == (6, 0, 6)
        assert lv.output_tokens == 30 and lv.input_tokens == 18
        assert lv.ttft_ms.p50 >= 15  # the first chunk comes one gap after the request
        assert 15 <= lv.tpot_ms.p50 < 200 and 15 <= lv.itl_ms.p50 < 200
        assert lv.latency_ms.p50 >= 4 * 20
    assert levels[1].output_throughput > levels[0].output_throughput * 1.5
    warmup, *sent = fake.bodies
    assert warmup["max_tokens"] == 4 and all(b["max_tokens"] == 8 for b in sent)
    assert all(b["temperature"] == 0 and b["ignore_eos"] and b["stream"] for b in sent)
    assert all(b["stream_options"] == {"include_usage": True} for b in sent)
    assert all(b["model"] == "fake-model" for b in sent)


def test_closed_loop_keeps_exactly_c_requests_in_flight():
    fake = FakeServer(tokens=3, gap_s=0.02)
    run_fake(fake, concurrency=[2], warmup=False)
    assert fake.max_in_flight == 2


def test_without_usage_tokens_are_counted_from_chunks():
    fake = FakeServer(tokens=6, usage=False, finish_chunk=True)
    _, [lv] = run_fake(fake, concurrency=[2])
    assert lv.output_tokens == 6 * 6  # the finish-only chunk is not a token
    assert lv.input_tokens == 0


def test_prompts_are_unique_per_request_and_level_unless_disabled():
    fake = FakeServer(tokens=1)
    run_fake(fake, concurrency=[1, 2])
    prompts = [b["prompt"] for b in fake.bodies]
    assert len(set(prompts)) == len(prompts) == 1 + 2 * 6
    assert all(p.split("\n", 1)[1] in PROMPTS for p in prompts)
    fake = FakeServer(tokens=1)
    run_fake(fake, concurrency=[1, 2], unique_prompts=False, warmup=False)
    assert [b["prompt"] for b in fake.bodies] == PROMPTS * 2


def test_shared_prefix_workload_interleaves_system_prompts():
    fake = FakeServer(tokens=1)
    prefixes = ["SYSTEM A " * 4, "SYSTEM B " * 4]
    _, levels = run_fake(fake, prefixes, concurrency=[1, 1], warmup=False, shared_prefixes=2)
    prompts = [b["prompt"] for b in fake.bodies]
    first, second = prompts[:6], prompts[6:]
    for level in (first, second):
        heads = [p.rsplit("\n", 1)[0] for p in level]  # marker and system prompt
        assert heads[0::2] == [heads[0]] * 3 and heads[1::2] == [heads[1]] * 3
        assert heads[0] != heads[1] and heads[0].endswith(prefixes[0])
        assert [p.rsplit("\n", 1)[1] for p in level] == PROMPTS
    assert not set(first) & set(second)  # a level reuses no prefix of the one before
    assert all(lv.prefix_hit_rate is None for lv in levels)  # the fake has no /metrics


def test_structured_requests_carry_a_schema_each():
    fake = FakeServer(tokens=1)
    run_fake(fake, concurrency=[1, 2], structured=True, warmup=False)
    schemas = [json.dumps(b["structured_outputs"]["json"]) for b in fake.bodies]
    assert len(set(schemas)) == len(fake.bodies) == 2 * 6
    fake = FakeServer(tokens=1)
    run_fake(fake, concurrency=[1], warmup=False)
    assert not any("structured_outputs" in b for b in fake.bodies)


def test_non_streaming_ttft_is_latency():
    fake = FakeServer(tokens=4, gap_s=0.01)
    _, [lv] = run_fake(fake, concurrency=[2], stream=False)
    assert (lv.completed, lv.output_tokens) == (6, 24)
    assert lv.ttft_ms == lv.latency_ms
    assert lv.tpot_ms is None and lv.itl_ms is None
    assert "stream_options" not in fake.bodies[-1]
    table = format_table([lv])
    assert table.splitlines()[-1].endswith("| - | - |")


def test_errors_are_counted_not_raised():
    fake = FakeServer(tokens=2, fail_every=3)
    cfg, (_, [lv]) = asyncio.run(_serve_and_bench(fake, concurrency=[1], warmup=False))
    assert (lv.completed, lv.errors) == (4, 2)
    assert lv.error_samples == ["HTTP 503: overloaded"]
    data = json.loads(json.dumps(results_json(cfg, "fake-model", [lv])))  # JSON-safe
    assert data["config"]["request_rate"] == "inf" and "api_key" not in data["config"]


def test_open_loop_poisson_arrivals():
    fake = FakeServer(tokens=2, gap_s=0.005)
    _, [lv] = run_fake(fake, concurrency=[4], request_rate=50.0)
    assert (lv.completed, lv.errors) == (6, 0)
    assert not math.isinf(lv.duration_s)


def test_shipped_dataset():
    prompts = load_dataset(None)
    assert DEFAULT_DATASET.name == "prompts.jsonl" and len(prompts) >= 64
    assert len(set(prompts)) == len(prompts)


def test_synthetic_prompts_have_the_exact_length():
    prompts = synthetic_prompts(3, 37, seed=1, tokenizer_path=None)
    tok, _ = tokenizer_words(None)
    assert [len(tok(p).input_ids) for p in prompts] == [37, 37, 37]
    assert len(set(prompts)) == 3 and prompts == synthetic_prompts(3, 37, 1, None)


# ---- end to end -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pagedserve_url(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("bench-serve") / "server.log"
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port)]
    cmd += ["--kv-cache-memory", "128MiB"]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server not ready:\n{log.read_text(errors='replace')}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_bench_serve_against_pagedserve(pagedserve_url, tmp_path: Path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "pagedserve.cli", "bench", "serve", "--base-url", pagedserve_url]
    cmd += ["--num-prompts", "4", "--max-tokens", "4", "--concurrency", "1,2"]
    cmd += ["--json", str(out), "--plot", str(png)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["model"] == "SmolLM2-135M-Instruct"
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    for lv in data["levels"]:
        assert (lv["completed"], lv["errors"], lv["output_tokens"]) == (4, 0, 16)
        assert lv["input_tokens"] > 4 * 20  # the shipped prompts are 20 tokens or more
        assert lv["output_throughput"] > 0 and lv["ttft_ms"]["p50"] > 0
        assert lv["tpot_ms"]["p50"] > 0 and lv["itl_ms"]["p50"] > 0
    assert "| 2 | 4/4 | 0 |" in result.stdout
    assert png.stat().st_size > 10_000
