"""Data parallelism on Ray Serve: a real `pagedserve serve --data-parallel-size 2` (a local Ray
instance, two replicas of a tiny random Llama, one core each) against the single-process server
on the same model, through the official `openai` client and plain HTTP. No mocks.

One application for the module (Ray's start-up is slow); its last test drains it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve.ray_serve.metrics_merge import merge_replica_metrics
from pagedserve.ray_serve.placement import NodeCapacity, ReplicaResources, placement_error
from pagedserve.ray_serve.prefix_index import BLOCK_CHARS, PrefixIndex, block_hashes
from pagedserve.ray_serve.relay import routing_key
from pagedserve.server.metrics import ServerMetrics
from test_server import ServerProcess, metric

pytest.importorskip("ray.serve")

REPLICA_HEADER = "x-pagedserve-replica"
PER_REPLICA_LIMIT = 3
MODEL = "tiny-llama"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3,"]
# Two system prompts, each many routing blocks (and KV pages) long.
SYSTEM_A = "You are a meticulous assistant for a library. " * 12
SYSTEM_B = "Answer as a terse ship captain who hates small talk. " * 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from pagedserve.models.loader import ModelSource, load_tokenizer

    path = tmp_path_factory.mktemp("models") / MODEL
    tokenizer = load_tokenizer(ModelSource.resolve(None))
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # wide weights: greedy choices far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("dp-logs")
    common = ("--model", tiny_model, "--kv-cache-memory", "16MiB")
    dp = ServerProcess(
        logs / "dp.log",
        *common,
        "--data-parallel-size",
        "2",
        "--max-concurrent-requests",
        str(PER_REPLICA_LIMIT),
        "--shutdown-grace-seconds",
        "60",
    )
    single = ServerProcess(logs / "single.log", *common)
    yield {"dp": dp, "single": single}
    single.stop()
    dp.stop()
    if dp.proc.returncode not in (0, None):  # killed: do not leave its Ray instance behind
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"])


@pytest.fixture(scope="module")
def dp(servers) -> ServerProcess:
    return servers["dp"].wait_ready(timeout=240)


@pytest.fixture(scope="module")
def single(servers) -> ServerProcess:
    return servers["single"].wait_ready()


# A replica builds the CPU kernels on its first request where they are not cached yet
# (minutes on a busy 2-core machine).
FIRST_REQUEST_TIMEOUT = 300


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=FIRST_REQUEST_TIMEOUT
    )


def fresh_metric(url: str, name: str, labels: dict[str, str]) -> float:
    """A replica's metric once its push after the last request has landed (pushes are 1 s)."""
    time.sleep(2.5)
    return metric(url, name, labels)


def replicas_in(url: str, expected: int = 2) -> set[str]:
    """The replica labels of /metrics, once `expected` replicas have pushed their series."""
    deadline = time.monotonic() + 15
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        found = set(re.findall(r'pagedserve_num_requests_running\{replica="(\w+)"\}', text))
        if len(found) >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def completion(url: str, prompt: str, max_tokens: int = 4, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=FIRST_REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    return r


# ---- pure parts: no Ray needed --------------------------------------------------------------
def test_routing_key_and_prefix_index():
    chat = b'{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]}'
    assert routing_key("/v1/chat/completions", chat) == "<system>S<user>q"
    assert routing_key("/v1/completions", b'{"prompt": ["first", "second"]}') == "first"
    assert routing_key("/v1/completions", b'{"prompt": [1, 2, 3]}') == "1 2 3"
    assert routing_key("/v1/completions", b"{not json") == ""
    assert routing_key("/tokenize", b'{"prompt": "x"}') == ""

    a, b = SYSTEM_A + "question one", SYSTEM_B + "question two"
    assert len(block_hashes(a)) == len(a) // BLOCK_CHARS
    index = PrefixIndex(capacity=1000)
    index.insert(block_hashes(a), "r1")
    index.insert(block_hashes(b), "r2")
    same_prefix = block_hashes(SYSTEM_A + "another question")
    matched = index.matched_blocks(same_prefix, ["r1", "r2"])
    assert matched["r1"] == len(SYSTEM_A) // BLOCK_CHARS and matched["r2"] == 0
    index.forget("r1")
    assert index.matched_blocks(same_prefix, ["r1", "r2"]) == {"r1": 0, "r2": 0}
    small = PrefixIndex(capacity=3)  # least recently used blocks leave first
    small.insert(block_hashes(a), "r1")
    assert small.held("r1") == 3


def test_metrics_merge_labels_each_replica():
    one, two = ServerMetrics(lambda: None), ServerMetrics(lambda: None)
    one.requests.labels("http", "/health", "200").inc()
    two.requests.labels("http", "/health", "200").inc(2)
    text = merge_replica_metrics({"r1": one.render().decode(), "r2": two.render().decode()})
    text = text.decode()
    assert text.count("# TYPE pagedserve_requests_total counter") == 1
    assert 'replica="r1",status="200"} 1.0' in text and 'replica="r2",status="200"} 2.0' in text


def test_placement_error_names_what_is_short():
    node = NodeCapacity("10.0.0.1", num_cpus=2, memory_bytes=8 << 30, num_gpus=0)
    need = ReplicaResources(num_cpus=1, memory_bytes=1 << 30, num_gpus=0)
    assert placement_error(2, need, [node]) is None
    assert "short of CPUs (room for 2)" in placement_error(3, need, [node])
    big = ReplicaResources(num_cpus=1, memory_bytes=5 << 30, num_gpus=0)
    assert "short of memory (room for 1)" in placement_error(2, big, [node])


def test_without_ray_says_how_to_install():
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from pagedserve.cli import main\n"
        "sys.exit(main(['serve', '--data-parallel-size', '2']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "pip install 'pagedserve[ray]'" in r.stderr and "ray[serve]==2.60.0" in r.stderr


def test_single_process_server_imports_no_ray():
    code = (
        "import sys\n"
        "from pagedserve.cli import build_parser\n"
        "import pagedserve.server.api_server\n"
        "args = build_parser().parse_args(['serve'])\n"
        "assert args.data_parallel_size == 1\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# ---- the application ------------------------------------------------------------------------
def test_greedy_equals_single_process_server(dp, single):
    got, want = client_of(dp), client_of(single)
    for prompt in PROMPTS:
        a = got.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        b = want.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert a.choices[0].text == b.choices[0].text and a.usage == b.usage
    messages = [{"role": "user", "content": "Say something."}]
    a = got.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    b = want.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert [m.id for m in got.models.list().data] == [MODEL]


def test_streaming_passes_token_by_token(dp):
    client = client_of(dp)
    whole = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=64,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=64, temperature=0, stream=True, logprobs=0,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    # Every token, in order, in events as they are made: one a token, but tokens made while a
    # busy machine's relay lagged travel together (the full suite's load merged 2 of 10 once).
    assert 1 < len(chunks) <= 64
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == 64
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    messages = [{"role": "user", "content": "Hello"}]
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    assert text == plain.choices[0].message.content
    r = httpx.post(f"{dp.url}/tokenize", json={"prompt": "Hello world"}, timeout=30)
    assert r.status_code == 200 and r.json()["count"] == 2


def test_prefix_affinity_routes_a_prefix_to_one_replica(dp):
    assert len(replicas_in(dp.url)) == 2
    first = completion(dp.url, SYSTEM_A + "Question 0?").headers[REPLICA_HEADER]
    (other,) = replicas_in(dp.url) - {first}
    hits = {r: fresh_metric(dp.url, "pagedserve_prefix_cache_hits_total", {"replica": r})
            for r in (first, other)}  # fmt: skip
    served = {completion(dp.url, SYSTEM_A + f"Question {i}?").headers[REPLICA_HEADER]
              for i in range(1, 5)}  # fmt: skip
    assert served == {first}
    after = {r: fresh_metric(dp.url, "pagedserve_prefix_cache_hits_total", {"replica": r})
             for r in (first, other)}  # fmt: skip
    assert after[first] - hits[first] >= 4 * 64  # the system prompt's pages, each time
    assert after[other] == hits[other]
    # A new prefix goes to the replica remembering fewer: both replicas take traffic.
    served_b = {completion(dp.url, SYSTEM_B + f"Order {i}").headers[REPLICA_HEADER]
                for i in range(3)}  # fmt: skip
    assert served_b == {other}


def test_disconnect_aborts_in_the_replica_and_frees_pages(dp):
    """Each dropped stream is aborted in the replica that served it, and its pages freed."""
    replicas = sorted(replicas_in(dp.url))

    def aborted(replica: str) -> float:
        labels = {"finish_reason": "abort", "replica": replica}
        return metric(dp.url, "pagedserve_request_finished_total", labels)

    time.sleep(2.5)  # the replicas' last pushes
    before = {r: aborted(r) for r in replicas}
    body = {"model": MODEL, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}

    async def open_and_drop(i: int) -> str:
        async with httpx.AsyncClient(timeout=60) as h:
            prompt = f"{i}: tell me a story"
            async with h.stream(
                "POST", f"{dp.url}/v1/completions", json={**body, "prompt": prompt, "stream": True}
            ) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 2:
                        return r.headers[REPLICA_HEADER]  # leaving closes the connection
        raise AssertionError("the stream ended early")

    async def main():
        return await asyncio.gather(*(open_and_drop(i) for i in range(4)))

    served = asyncio.run(main())
    expected = {r: float(served.count(r)) for r in replicas}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.5)
        busy = sum(
            metric(dp.url, name)
            for name in ("pagedserve_kv_cache_usage", "pagedserve_num_requests_running")
        )
        got = {r: aborted(r) - before[r] for r in replicas}
        if busy == 0 and got == expected:
            break
    else:
        pytest.fail(f"not aborted and freed: busy={busy} aborted={got}, served={expected}")


def test_application_limit_answers_429_with_retry_after(dp):
    limit = 2 * PER_REPLICA_LIMIT
    body = {"model": MODEL, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=120) as h:
            opened = []
            for i in range(limit):
                req = h.build_request(
                    "POST", f"{dp.url}/v1/completions",
                    json={**body, "prompt": f"{i} hold", "stream": True},
                )  # fmt: skip
                r = await h.send(req, stream=True)
                assert r.status_code == 200
                opened.append(r)
            over = await h.post(f"{dp.url}/v1/completions", json={**body, "prompt": "one more"})
            for r in opened:
                await r.aclose()
            return over

    over = asyncio.run(main())
    assert over.status_code == 429 and over.headers["retry-after"] == "1"
    assert over.json()["error"]["code"] == "rate_limit_exceeded"
    assert metric(dp.url, "pagedserve_app_requests_rejected_total", {"reason": "concurrency"}) >= 1


def engine_replica_pids() -> list[int]:
    """Pids of this machine's engine replica processes (Ray titles them by deployment)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if proc.name.isdigit() and b"ServeReplica:pagedserve:PagedserveEngine" in cmdline:
            pids.append(int(proc.name))
    return pids


def test_replica_killed_under_load(dp):
    """Streams on a killed replica end with an error event, the others finish, Ray replaces
    it, and every request after that succeeds."""
    before = replicas_in(dp.url)
    pids = engine_replica_pids()
    assert len(pids) == 2
    body = {"model": MODEL, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}

    async def stream(h: httpx.AsyncClient, i: int) -> list[str]:
        json_body = {**body, "prompt": f"{i}: keep going", "stream": True}
        async with h.stream("POST", f"{dp.url}/v1/completions", json=json_body) as r:
            assert r.status_code == 200
            return [line async for line in r.aiter_lines() if line.startswith("data: ")]

    async def main():
        async with httpx.AsyncClient(timeout=120) as h:
            tasks = [asyncio.create_task(stream(h, i)) for i in range(4)]
            await asyncio.sleep(1.5)
            os.kill(pids[0], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    ends = [lines[-1] for lines in asyncio.run(main())]
    assert set(ends) <= {"data: [DONE]"} | {e for e in ends if '"replica_unavailable"' in e}
    assert "data: [DONE]" in ends and len(set(ends)) == 2, ends
    deadline = time.monotonic() + 90
    while replicas_in(dp.url) & before == before or len(replicas_in(dp.url)) < 2:
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(1.0)
    codes = [
        httpx.post(
            f"{dp.url}/v1/completions", json={**body, "prompt": p, "max_tokens": 4}
        ).status_code
        for p in PROMPTS * 3
    ]
    assert codes == [200] * len(codes)


def test_too_many_replicas_is_a_clear_error(dp, tiny_model):
    """On its own local Ray instance (one started by another process takes no other driver)."""
    r = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "serve", "--data-parallel-size", "3",
         "--num-threads", "1", "--model", tiny_model, "--port", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--data-parallel-size 3 needs 3 replicas of 1 CPU" in r.stderr
    assert "short of CPUs (room for 2)" in r.stderr


def test_sigterm_drains_every_replica(dp):
    """Last: a stream in flight finishes whole after SIGTERM, new requests get 503, exit 0."""
    # Long enough that the drain is still waiting for it when the next request comes (a quiet
    # machine finished 300 tokens of the tiny model within a second, and the app was gone: 404).
    body = {"model": MODEL, "prompt": "drain me", "max_tokens": 1800, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(timeout=120) as h:
            req = h.build_request(
                "POST", f"{dp.url}/v1/completions",
                json={**body, "stream": True, "ignore_eos": True},
            )  # fmt: skip
            r = await h.send(req, stream=True)
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            dp.proc.send_signal(signal.SIGTERM)
            for _ in range(25):  # until the signal handler has started the front door's drain
                await asyncio.sleep(0.2)
                refused = await h.post(f"{dp.url}/v1/completions", json={**body, "max_tokens": 4})
                if refused.status_code != 200:
                    break
            rest = [line async for line in lines if line.startswith("data: ")]
            return refused, rest

    refused, rest = asyncio.run(main())
    assert refused.status_code == 503, refused.text
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    assert dp.proc.wait(60) == 0
