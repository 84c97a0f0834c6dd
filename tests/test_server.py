"""End-to-end tests of the OpenAI-compatible server: real servers in subprocesses, real clients.

Two servers per module: `server` (defaults) and `limited` (--max-concurrent-requests 4 and an API
key), both started at once so their model loads overlap. No mocks: every assertion is about
what a client sees over HTTP or what /metrics reports.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.cpu_kernels import isa

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key-123"
# One torch thread each: two servers on a small shared machine must not oversubscribe the CPUs.
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "128MiB", "--num-threads", "1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, log_path: Path, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(self.port)]
        env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_API_KEY"}
        self.proc = subprocess.Popen(
            [*cmd, *ENGINE_FLAGS, *flags], stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        self._ready = False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        if self._ready:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                if r.status_code == 200:
                    self._ready = True
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("server-logs")
    main = ServerProcess(logs / "main.log")
    limited = ServerProcess(
        logs / "limited.log", "--max-concurrent-requests", "4", "--api-key", API_KEY
    )
    yield {"main": main, "limited": limited}
    main.stop()
    limited.stop()


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers["main"].wait_ready()


@pytest.fixture(scope="module")
def limited(servers) -> ServerProcess:
    return servers["limited"].wait_ready()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from pagedserve.models.loader import ModelSource, load_tokenizer

    return load_tokenizer(ModelSource.resolve(None))


def greedy(client, prompt, max_tokens=12, **kw):
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
    )


def chat_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in (labels or {}).items()):
            total, found = total + float(m.group(4)), True
    if not found and labels is None:
        raise AssertionError(f"metric {name} not exported")
    return total


# ---- basics ---------------------------------------------------------------------------------
def test_health_version_models(server, client):
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200
    version = httpx.get(f"{server.url}/version").json()
    assert version["version"] and version["cpu_kernel_level"] == isa.kernel_level()
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_usage_exact(server, client, tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog. Then the fox"
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    n_prompt = len(tokenizer.encode(prompt))
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == n_prompt + 8
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text
    assert out.model == MODEL and out.object == "text_completion"
    tok = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": prompt}).json()
    assert tok["count"] == n_prompt and tok["tokens"] == tokenizer.encode(prompt)
    assert tok["max_model_len"] > 0
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == prompt


def test_chat_usage_exact(client, tokenizer):
    messages = chat_messages("What is the capital of France?")
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0
    )
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    n_prompt = len(tokenizer.encode(text, add_special_tokens=False))
    assert out.usage.prompt_tokens == n_prompt
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert out.usage.completion_tokens <= 10
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "length":
        assert out.usage.completion_tokens == 10


def test_stream_equals_non_stream_completion(client):
    prompt = "Once upon a time, in a small village,"
    ref = greedy(client, prompt, max_tokens=12)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.choices[0].text
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [ref.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == ref.usage


def test_stream_equals_non_stream_chat(client):
    messages = chat_messages("Name three colors.")
    ref = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.choices[0].message.content
    assert chunks[-1].usage == ref.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        ref.choices[0].finish_reason
    )


def test_n2_and_seed_reproducible(client):
    def sample():
        out = client.completions.create(
            model=MODEL, prompt="My favourite food is", max_tokens=8, temperature=1.0, n=2, seed=7
        )
        return sorted((c.index, c.text) for c in out.choices), out.usage

    first, usage = sample()
    second, _ = sample()
    assert [i for i, _ in first] == [0, 1]
    assert first == second
    assert 2 <= usage.completion_tokens <= 16
    chat = client.chat.completions.create(
        model=MODEL, messages=chat_messages("Say hi"), max_tokens=4, n=2, temperature=0
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_stop_strings(client):
    prompt = "Count: one, two, three, four, five,"
    full = greedy(client, prompt, max_tokens=12).choices[0].text
    words = [w for w in re.findall(r"[a-z]+", full)]
    assert words, full
    stop = words[len(words) // 2]
    cut = full[: full.index(stop)]
    out = greedy(client, prompt, max_tokens=12, stop=[stop])
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut
    chat = client.chat.completions.create(
        model=MODEL, messages=chat_messages("Count from 1 to 5."), max_tokens=12, temperature=0
    )
    content = chat.choices[0].message.content
    if len(content) > 3:
        stop = content[2:4]
        stopped = client.chat.completions.create(
            model=MODEL,
            messages=chat_messages("Count from 1 to 5."),
            max_tokens=12,
            temperature=0,
            stop=[stop],
        )
        assert stopped.choices[0].message.content == content[: content.index(stop)]
        assert stopped.choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    out = greedy(client, "The sun rises in the", max_tokens=6, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0.0
        assert 3 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely
        assert top[tok] == pytest.approx(value)
    streamed = client.completions.create(
        model=MODEL,
        prompt="The sun rises in the",
        max_tokens=6,
        temperature=0,
        logprobs=3,
        stream=True,
    )
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens if c.choices else [])]
    assert tokens == lp.tokens


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("Hello!"),
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token or (
            "\ufffd" in entry.token
        )
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert out.choices[0].message.content in joined  # the final <|im_end|> may be included


def test_echo_and_prompt_forms(client, tokenizer):
    prompt = "Water boils at"
    out = greedy(client, prompt, max_tokens=4, echo=True)
    plain = greedy(client, prompt, max_tokens=4)
    assert out.choices[0].text == prompt + plain.choices[0].text
    ids = tokenizer.encode(prompt)
    by_ids = greedy(client, ids, max_tokens=4)
    assert by_ids.choices[0].text == plain.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    two = greedy(client, [prompt, "Ice melts at"], max_tokens=4)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert next(c for c in two.choices if c.index == 0).text == plain.choices[0].text
    assert two.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Ice melts at"))
    assert two.usage.completion_tokens <= 8
    id_lists = greedy(client, [ids, ids], max_tokens=4, n=2)
    assert sorted(c.index for c in id_lists.choices) == [0, 1, 2, 3]
    assert {c.text for c in id_lists.choices} == {plain.choices[0].text}
    echoed = greedy(client, ids, max_tokens=4, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text


# ---- concurrency ----------------------------------------------------------------------------
PROMPTS = [
    "The history of Rome begins",
    "A recipe for pancakes:",
    "def fibonacci(n):",
    "In 1969, astronauts",
]


def test_32_concurrent_streams_match_solo(server, client):
    solo = [greedy(client, p, max_tokens=10).choices[0].text for p in PROMPTS]
    aclient = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300
    )

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def health_probe(stop: asyncio.Event, latencies: list[float]) -> None:
        async with httpx.AsyncClient(timeout=30) as h:
            while not stop.is_set():
                t0 = time.monotonic()
                r = await h.get(f"{server.url}/health")
                latencies.append(time.monotonic() - t0)
                assert r.status_code == 200
                await asyncio.sleep(0.1)

    async def main():
        stop, latencies = asyncio.Event(), []
        probe = asyncio.create_task(health_probe(stop, latencies))
        texts = await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(32)))
        stop.set()
        await probe
        await aclient.close()
        return texts, latencies

    texts, latencies = asyncio.run(main())
    for i, text in enumerate(texts):
        assert text == solo[i % len(PROMPTS)], f"stream {i} differs from its solo run"
    assert latencies, "health was never probed"
    # /health is served on the event loop while the engine computes in its own thread.
    assert max(latencies) < 2.0, latencies


def test_disconnect_aborts_and_frees_pages(server, client):
    aborted_before = metric(
        server.url, "pagedserve_request_finished_total", {"finish_reason": "abort"}
    )
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story:",
        "max_tokens": 1000,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def open_and_drop(i: int) -> int:
        async with httpx.AsyncClient(timeout=60) as h:
            async with h.stream(
                "POST",
                f"{server.url}/v1/completions",
                json={**body, "stream": True, "prompt": f"{i}: {body['prompt']}"},
            ) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if seen == 2:
                            return seen  # leaving the block closes the socket mid-stream
        return seen

    async def non_stream_timeout() -> None:
        async with httpx.AsyncClient(timeout=1.5) as h:
            with pytest.raises(httpx.ReadTimeout):
                await h.post(f"{server.url}/v1/completions", json=body)

    async def main():
        return await asyncio.gather(
            *(open_and_drop(i) for i in range(8)), non_stream_timeout(), non_stream_timeout()
        )

    results = asyncio.run(main())
    assert results[:8] == [2] * 8
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        usage = metric(server.url, "pagedserve_kv_cache_usage")
        running = metric(server.url, "pagedserve_num_requests_running")
        waiting = metric(server.url, "pagedserve_num_requests_waiting")
        if usage == 0 and running == 0 and waiting == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"KV pages not freed after disconnects: usage={usage} running={running}")
    aborted = metric(server.url, "pagedserve_request_finished_total", {"finish_reason": "abort"})
    assert aborted - aborted_before == 10
    assert metric(server.url, "pagedserve_requests_in_flight") == 0
    out = greedy(client, "After the disconnects,", max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens > 0


# ---- errors ---------------------------------------------------------------------------------
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CHAT = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    # (path, body, status, param)
    (CMPL, b"{not json", 400, None),
    (CMPL, b"[1, 2]", 400, None),
    (CMPL, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "n": 0}, 400, "n"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi " * 4000, "max_tokens": None}, 400, "prompt"),
    (CMPL, {"prompt": ""}, 400, "prompt"),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": [10**9]}, 400, "prompt"),
    (CMPL, {"prompt": ["ok", ""]}, 400, "prompt[1]"),
    (CMPL, {"max_tokens": 4}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (CMPL, {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "logprobs"),
    (CMPL, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    (CMPL, {"prompt": "hi", "no_such_param": 1}, 400, "no_such_param"),
    (CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [10**9], "min_tokens": 1}, 400, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": OK_CHAT, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    (CHAT, {"messages": OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": OK_CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": OK_CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    (CHAT, {"messages": OK_CHAT, "model": "other"}, 404, "model"),
    (CHAT, {"messages": OK_CHAT, "frequency_penalty": 5}, 400, "frequency_penalty"),
    ("/tokenize", {"prompt": "hi", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


def _assert_error_body(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS)
def test_bad_inputs(server, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}{path}", headers={"content-type": "application/json"}, **kw)
    _assert_error_body(r, status, param)


def test_body_too_large_and_unknown_route(server):
    big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
    r = httpx.post(f"{server.url}{CMPL}", content=big, headers={"content-type": "application/json"})
    _assert_error_body(r, 413)
    _assert_error_body(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    _assert_error_body(httpx.get(f"{server.url}{CMPL}"), 405)


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=OK_CHAT)


def test_metrics_exported(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in [
        "pagedserve_num_requests_running",
        "pagedserve_num_requests_waiting",
        "pagedserve_kv_cache_usage",
        "pagedserve_num_preemptions_total",
        "pagedserve_prompt_tokens_total",
        "pagedserve_generation_tokens_total",
        "pagedserve_time_to_first_token_seconds_bucket",
        "pagedserve_time_per_output_token_seconds_bucket",
        "pagedserve_e2e_request_latency_seconds_bucket",
        "pagedserve_request_queue_time_seconds_bucket",
        "pagedserve_prefix_cache_queries_total",
        "pagedserve_prefix_cache_hits_total",
        "pagedserve_kv_cache_tokens_used",
        "pagedserve_kv_cache_tokens_wasted",
    ]:
        assert name in text, name
    assert metric(server.url, "pagedserve_kv_cache_tokens_total") > 0
    assert metric(server.url, "pagedserve_time_to_first_token_seconds_count") > 0
    assert metric(server.url, "pagedserve_generation_tokens_total") > 0
    assert metric(server.url, "pagedserve_request_finished_total", {"finish_reason": "length"}) > 0
    assert metric(server.url, "pagedserve_request_finished_total", {"finish_reason": "stop"}) > 0
    ok = {"protocol": "http", "endpoint": "/v1/completions", "status": "200"}
    assert metric(server.url, "pagedserve_requests_total", ok) > 0
    bad = {"protocol": "http", "endpoint": "/v1/completions", "status": "400"}
    assert metric(server.url, "pagedserve_requests_total", bad) > 0
    log = server.log()
    assert "Avg prompt throughput" in log  # logged every few seconds while busy
    assert "Prefix cache hit rate" in log and "unfilled" in log
    assert f"Serving {MODEL}" in log and f"127.0.0.1:{server.port}" in log  # the startup line


# ---- the limited server: API key, overload, SIGTERM ------------------------------------------
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_api_key(limited):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    url = f"{limited.url}{CMPL}"
    _assert_error_body(httpx.post(url, json=body), 401)
    _assert_error_body(httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}), 401)
    _assert_error_body(httpx.get(f"{limited.url}/v1/models"), 401)
    _assert_error_body(httpx.post(f"{limited.url}/tokenize", json={"prompt": "hi"}), 401)
    assert httpx.post(url, json=body, headers=AUTH).status_code == 200
    assert httpx.get(f"{limited.url}/health").status_code == 200
    assert httpx.get(f"{limited.url}/metrics").status_code == 200
    keyed = openai.OpenAI(base_url=f"{limited.url}/v1", api_key=API_KEY, max_retries=0)
    assert keyed.models.list().data[0].id == MODEL
    wrong = openai.OpenAI(base_url=f"{limited.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_overload_gets_429_never_500(limited):
    body = {
        "model": MODEL,
        "prompt": "Write a poem about the sea:",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def main():
        async with httpx.AsyncClient(timeout=300, headers=AUTH) as h:
            return await asyncio.gather(
                *(h.post(f"{limited.url}{CMPL}", json=body) for _ in range(16))
            )

    responses = asyncio.run(main())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, statuses
    assert 200 in statuses and 429 in statuses, statuses
    assert statuses.count(200) >= 4
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            _assert_error_body(r, 429)
        else:
            out = r.json()
            assert out["choices"][0]["finish_reason"] == "length"
            assert out["usage"]["completion_tokens"] == 8
    rejected = metric(limited.url, "pagedserve_requests_total", {"status": "429"})
    assert rejected == statuses.count(429)
    assert metric(limited.url, "pagedserve_requests_total", {"status": "500"}) == 0


def test_sigterm_drains_then_exits_zero(servers, limited):
    """Last test of the module: it shuts the limited server down."""
    body = {
        "model": MODEL,
        "prompt": "Describe a forest:",
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=120, headers=AUTH) as h:
        with h.stream("POST", f"{limited.url}{CMPL}", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"]
            limited.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            status = None
            while time.monotonic() < deadline:
                with httpx.Client(timeout=10, headers=AUTH) as other:
                    status = other.post(f"{limited.url}{CMPL}", json=body).status_code
                if status == 503:
                    break
                time.sleep(0.1)
            assert status == 503
            assert httpx.get(f"{limited.url}/health").status_code == 503
            rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(x) for x in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert limited.proc.wait(60) == 0


# ---- the async engine in process: failures and aborts -------------------------------------
@pytest.fixture(scope="module")
def engine():
    from pagedserve.config import EngineConfig
    from pagedserve.engine import LLMEngine

    return LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="64MiB", num_threads=1))


def test_async_engine_errors_aborts_and_recovery(engine, monkeypatch):
    from pagedserve.async_engine import AsyncEngine, EngineStepError
    from pagedserve.sampling_params import SamplingParams

    async def last(gen):
        outs = [out async for out in gen]
        return outs[-1]

    async def wait_idle(ae: AsyncEngine) -> None:
        for _ in range(200):
            s = ae.stats()
            if s.num_running == 0 and s.num_waiting == 0 and s.kv_pages_used == 0:
                return
            await asyncio.sleep(0.05)
        pytest.fail(f"engine not idle: {ae.stats()}")

    async def main():
        ae = AsyncEngine(engine, log_interval_seconds=60)
        ae.start()
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        short = SamplingParams(temperature=0, max_tokens=4)

        # A step that raises (a fault injected into the model runner for the step that first
        # holds "bad") fails every request in that step with an error instead of hanging them.
        good = asyncio.create_task(last(ae.generate("Hello there", long, "good")))
        real_execute = engine.runner.execute

        def fail_once(out, sample_rows):
            if any(s.seq.request_id == "bad" for s in out.scheduled):
                monkeypatch.setattr(engine.runner, "execute", real_execute)
                raise RuntimeError("injected fault")
            return real_execute(out, sample_rows)

        monkeypatch.setattr(engine.runner, "execute", fail_once)
        with pytest.raises(EngineStepError):
            await last(ae.generate("Boom", short, "bad"))
        with pytest.raises(EngineStepError):
            await good
        await wait_idle(ae)
        ok = await last(ae.generate("After the failure,", short, "ok"))
        assert ok.finished and len(ok.outputs[0].token_ids) == 4

        # An engine-side ValueError (duplicate request id) reaches only that request.
        first = ae.generate("One", long, "dup")
        assert (await anext(first)).request_id == "dup"
        with pytest.raises(ValueError):
            await last(ae.generate("Two", short, "dup"))

        # Aborted from outside: the stream ends with finish_reason 'abort'.
        ae.abort("dup")
        final = await last(first)
        assert final.finished and final.outputs[0].finish_reason == "abort"
        await wait_idle(ae)

        # The consumer walks away: closing the stream aborts the request and frees its pages.
        gen = ae.generate("Walk away", long, "walk")
        await anext(gen)
        assert ae.stats().kv_pages_used > 0
        await gen.aclose()
        await wait_idle(ae)
        assert engine.counters.finished_by_reason.get("abort", 0) >= 2
        ae.shutdown()
        assert not ae.is_running

    asyncio.run(main())
