"""End-to-end tests of the gRPC API: one real server subprocess (`serve --grpc-port`, an API key,
an in-flight limit) and real grpcio clients, checked against the same server's HTTP API.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import jsonschema
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedserve.server.api_server import create_app
from pagedserve.server.config import ServerConfig
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from test_server import MODEL, ServerProcess, _free_port, metric

API_KEY = "grpc-key-456"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
LIMIT = 40  # --max-concurrent-requests: room for the 32-stream mixed load, small enough to fill
SERVICE = "pagedserve.v1.Generation"
ROOT = Path(__file__).resolve().parents[1]
# A refused connection puts a channel in backoff (1 s, growing); poll a starting server faster.
FAST_RECONNECT = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 200),
)


class GrpcServer:
    def __init__(self, log_path: Path):
        self.grpc_port = _free_port()
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.http = ServerProcess(
            log_path,
            "--grpc-port",
            str(self.grpc_port),
            "--api-key",
            API_KEY,
            "--max-concurrent-requests",
            str(LIMIT),
        )
        self.proc = self.http.proc
        self.url = self.http.url
        self._ready = False

    def wait_ready(self, timeout: float = 180.0) -> GrpcServer:
        if self._ready:
            return self
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target, options=FAST_RECONNECT) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited:\n{self.http.log()}")
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                except grpc.RpcError:  # not listening yet
                    time.sleep(0.2)
                    continue
                if status == health_pb2.HealthCheckResponse.SERVING:
                    self._ready = True
                    self.http.wait_ready(timeout=30)
                    return self
                time.sleep(0.2)
        raise RuntimeError(f"gRPC server not ready after {timeout} s:\n{self.http.log()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> GrpcServer:
    s = GrpcServer(tmp_path_factory.mktemp("grpc-logs") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.http.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def req(text: str = "", **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, **kw) if text else pb.GenerateRequest(**kw)


def wait_idle(server: GrpcServer, timeout: float = 30.0) -> None:
    """Every KV page back in the pool (prefix-cache pages do not count), nothing in flight."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        values = [
            metric(server.url, "pagedserve_kv_cache_usage"),
            metric(server.url, "pagedserve_num_requests_running"),
            metric(server.url, "pagedserve_num_requests_waiting"),
            metric(server.url, "pagedserve_requests_in_flight"),
        ]
        if values == [0, 0, 0, 0]:
            return
        time.sleep(0.2)
    pytest.fail(f"server not idle: usage, running, waiting, in flight = {values}")


# ---- build ----------------------------------------------------------------------------------
def test_generated_code_is_current(tmp_path):
    """The checked-in code under src/pagedserve/v1 is what `make proto` makes of the .proto."""
    from grpc_tools import protoc

    proto = "pagedserve/v1/generation.proto"
    args = ["protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}"]
    args += [f"--grpc_python_out={tmp_path}", str(ROOT / "proto" / proto)]
    assert protoc.main(args) == 0
    for name in ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"):
        fresh = (tmp_path / "pagedserve" / "v1" / name).read_text()
        assert fresh == (ROOT / "src" / "pagedserve" / "v1" / name).read_text(), (
            f"{name} is stale: run `make proto`"
        )


# ---- health, reflection, model info ---------------------------------------------------------
def test_loading_then_load_failure():
    """While the model loads, HTTP answers 503 `model_loading` (Retry-After) and gRPC says
    NOT_SERVING and UNAVAILABLE; a failed load keeps both refusing and asks the server to exit.
    The real app and gRPC server in this process, the load held on an event so that the loading
    window is certain (the default model loads in about a second, too short for a poller)."""
    release = threading.Event()

    def load_engine():
        release.wait(30)
        raise RuntimeError("no such weights")

    grpc_port = _free_port()
    app = create_app(ServerConfig(port=0, grpc_port=grpc_port), load_engine)
    state = app.state.server
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    async def main() -> None:
        exit_asked = asyncio.Event()
        state.request_exit = exit_asked.set
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http,
            grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        ):
            health = health_pb2_grpc.HealthStub(channel)
            stub = pb_grpc.GenerationStub(channel)

            async def refusals(message: str) -> None:
                for path, body in (("/health", None), ("/v1/completions", {"prompt": "hi"})):
                    r = await (http.get(path) if body is None else http.post(path, json=body))
                    assert r.status_code == 503 and r.headers["retry-after"] == "5"
                    assert r.json() == {
                        "error": {
                            "message": message,
                            "type": "server_error",
                            "param": None,
                            "code": "model_loading",
                        }
                    }
                checks = [
                    health.Check(health_pb2.HealthCheckRequest(service=s), timeout=5)
                    for s in ("", SERVICE)
                ]
                assert [r.status for r in await asyncio.gather(*checks)] == [not_serving] * 2
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Generate(pb.GenerateRequest(text="hi"), timeout=5)
                assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNAVAILABLE, message)

            await refusals("the model is still loading")
            release.set()
            await asyncio.wait_for(exit_asked.wait(), 30)
            assert isinstance(state.load_error, RuntimeError)
            await refusals("the model failed to load")

    try:
        asyncio.run(main())
    finally:
        release.set()


def test_health_and_reflection(server):
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        (answer,) = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for s in answer.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names
    assert "gRPC API" in server.http.log() and server.target in server.http.log()


def test_model_info_tokenize_detokenize(server, stub):
    info = stub.ModelInfo(pb.ModelInfoRequest(), metadata=AUTH, timeout=10)
    assert info.model == MODEL and info.max_model_len > 0 and info.vocab_size > 0
    assert info.dtype == "float32" and info.device == "cpu" and info.kv_cache_tokens > 0
    text = "The quick brown fox jumps over the lazy dog."
    tok = stub.Tokenize(pb.TokenizeRequest(text=text), metadata=AUTH, timeout=10)
    http = httpx.post(
        f"{server.url}/tokenize", json={"prompt": text}, headers={"authorization": AUTH[0][1]}
    ).json()
    assert list(tok.token_ids) == http["tokens"] and tok.max_model_len == info.max_model_len
    detok = stub.Detokenize(pb.DetokenizeRequest(token_ids=tok.token_ids), metadata=AUTH)
    assert detok.text == text


# ---- generation against HTTP ----------------------------------------------------------------
def test_generate_and_stream_match_http(stub, client):
    prompt = "Once upon a time, in a small village,"
    http = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2
    )
    choice = http.choices[0]
    r = stub.Generate(
        req(prompt, max_tokens=12, temperature=0, logprobs=2), metadata=AUTH, timeout=60
    )
    (c,) = r.completions
    assert r.request_id.startswith("grpc-")
    assert c.text == choice.text
    assert [lp.token for lp in c.logprobs] == choice.logprobs.tokens
    assert [lp.token_id for lp in c.logprobs] == list(c.token_ids)
    for lp, ref in zip(c.logprobs, choice.logprobs.token_logprobs, strict=True):
        assert lp.logprob == pytest.approx(ref, abs=1e-5)
        assert len(lp.top_logprobs) in (2, 3)
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)  # greedy: the top one
    assert pb.FinishReason.Name(c.finish_reason) == f"FINISH_REASON_{choice.finish_reason.upper()}"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        http.usage.prompt_tokens,
        http.usage.completion_tokens,
        http.usage.total_tokens,
    )
    assert r.usage.completion_tokens == len(c.token_ids)

    # The stream: deltas join to the same text and tokens; only the last message finishes.
    msgs = list(
        stub.GenerateStream(
            req(prompt, max_tokens=12, temperature=0, request_id="mine-1"),
            metadata=AUTH,
            timeout=60,
        )
    )
    assert len(msgs) > 1 and {m.request_id for m in msgs} == {"mine-1"}
    deltas = [d for m in msgs for d in m.completions]
    assert "".join(d.text for d in deltas) == c.text
    assert [t for d in deltas for t in d.token_ids] == list(c.token_ids)
    assert [d.finish_reason for d in deltas][-1] == c.finish_reason
    assert all(d.finish_reason == pb.FINISH_REASON_UNSPECIFIED for d in deltas[:-1])
    assert [m.HasField("usage") for m in msgs] == [False] * (len(msgs) - 1) + [True]
    assert msgs[-1].usage == r.usage

    # The same prompt as token ids.
    ids = stub.Tokenize(pb.TokenizeRequest(text=prompt), metadata=AUTH).token_ids
    by_ids = stub.Generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=12, temperature=0),
        metadata=AUTH,
        timeout=60,
    )
    assert list(by_ids.completions[0].token_ids) == list(c.token_ids)


def test_stop_ignore_eos_and_n(stub, client):
    prompt = "Count: one, two, three, four, five,"
    full = stub.Generate(req(prompt, max_tokens=12, temperature=0), metadata=AUTH, timeout=60)
    text = full.completions[0].text
    stop = text.split()[len(text.split()) // 2]
    http = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    r = stub.Generate(
        req(prompt, max_tokens=12, temperature=0, stop=[stop]), metadata=AUTH, timeout=60
    )
    (c,) = r.completions
    assert c.text == http.choices[0].text == text[: text.index(stop)]
    assert c.finish_reason == pb.FINISH_REASON_STOP and c.stop_string == stop
    ids = list(full.completions[0].token_ids)
    k = next(i for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    stopped = stub.Generate(
        req(prompt, max_tokens=12, temperature=0, stop_token_ids=[ids[k]]),
        metadata=AUTH,
        timeout=60,
    )
    assert list(stopped.completions[0].token_ids) == ids[: k + 1]
    assert stopped.completions[0].stop_token_id == ids[k]
    msgs = list(
        stub.GenerateStream(
            req("My favourite food is", max_tokens=5, n=2, seed=3, ignore_eos=True),
            metadata=AUTH,
            timeout=60,
        )
    )
    per_index: dict[int, list[int]] = {0: [], 1: []}
    for m in msgs:
        for d in m.completions:
            per_index[d.index] += d.token_ids
    assert [len(v) for v in per_index.values()] == [5, 5]
    assert msgs[-1].usage.completion_tokens == 10


def test_mixed_load_16_grpc_and_16_http_streams(server, client):
    prompts = ["The history of Rome begins", "A recipe for pancakes:", "def fibonacci(n):"]
    prompts.append("In 1969, astronauts")
    solo = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    aclient = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300
    )

    async def over_http(prompt: str) -> str:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def over_grpc(stub, prompt: str) -> str:
        call = stub.GenerateStream(
            req(prompt, max_tokens=8, temperature=0), metadata=AUTH, timeout=300
        )
        return "".join([d.text async for m in call for d in m.completions])

    async def main():
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            jobs = [over_grpc(stub, prompts[i % 4]) for i in range(16)]
            jobs += [over_http(prompts[i % 4]) for i in range(16)]
            texts = await asyncio.gather(*jobs)
        await aclient.close()
        return texts

    texts = asyncio.run(main())
    for i, text in enumerate(texts):
        kind = "gRPC" if i < 16 else "HTTP"
        assert text == solo[i % 4], f"{kind} stream {i} differs from its solo run"
    wait_idle(server)


# ---- cancellation, deadlines, admission -----------------------------------------------------
LONG = {"max_tokens": 1000, "temperature": 0, "ignore_eos": True}


def test_limit_shared_with_http_then_cancel_frees_pages(server, stub):
    """LIMIT gRPC streams fill the in-flight limit that HTTP shares; cancelling frees it all."""
    aborted = {"protocol": "grpc", "finish_reason": "abort"}
    aborted_before = metric(server.url, "pagedserve_request_finished_total", aborted)

    async def main():
        async with grpc.aio.insecure_channel(server.target) as channel:
            astub = pb_grpc.GenerationStub(channel)
            calls = [
                astub.GenerateStream(req(f"{i}: Tell me a long story:", **LONG), metadata=AUTH)
                for i in range(LIMIT)
            ]
            for call in calls:  # every stream admitted and generating
                assert (await call.read()).completions
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await astub.Generate(req("one more", max_tokens=2), metadata=AUTH, timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            async with httpx.AsyncClient(timeout=30) as h:
                r = await h.post(
                    f"{server.url}/v1/completions",
                    json={"prompt": "one more", "max_tokens": 2},
                    headers={"authorization": AUTH[0][1]},
                )
            assert r.status_code == 429
            assert metric(server.url, "pagedserve_kv_cache_usage") > 0
            for call in calls:
                call.cancel()
            for call in calls:
                assert await call.code() == grpc.StatusCode.CANCELLED

    asyncio.run(main())
    wait_idle(server)
    after = metric(server.url, "pagedserve_request_finished_total", aborted)
    assert after - aborted_before == LIMIT
    rejected = {"protocol": "grpc", "reason": "concurrency"}
    assert metric(server.url, "pagedserve_requests_rejected_total", rejected) >= 1
    r = stub.Generate(req("After the cancellations,", max_tokens=4), metadata=AUTH, timeout=60)
    assert r.usage.completion_tokens > 0


def test_deadline_and_unary_cancel_free_pages(server, stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(req("A deadline:", **LONG), metadata=AUTH, timeout=1.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    seen = 0
    with pytest.raises(grpc.RpcError) as e:
        for _ in stub.GenerateStream(req("A streamed deadline:", **LONG), metadata=AUTH, timeout=2):
            seen += 1
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and seen > 0
    wait_idle(server)

    async def cancel_unary():
        async with grpc.aio.insecure_channel(server.target) as channel:
            call = pb_grpc.GenerationStub(channel).Generate(
                req("Cancel me:", **LONG), metadata=AUTH
            )
            await asyncio.sleep(1.0)
            call.cancel()
            assert await call.code() == grpc.StatusCode.CANCELLED

    asyncio.run(cancel_unary())
    wait_idle(server)
    r = stub.Generate(req("After the deadline,", max_tokens=4), metadata=AUTH, timeout=60)
    assert r.completions[0].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    for status in ("DEADLINE_EXCEEDED", "CANCELLED"):
        labels = {"protocol": "grpc", "status": status}
        assert metric(server.url, "pagedserve_requests_total", labels) >= 1, status


def test_structured_outputs(stub):
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "integer"}},
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    so = pb.StructuredOutputs(json=json.dumps(schema))
    r = stub.Generate(
        req("A color and a number as JSON:", max_tokens=40, temperature=0, structured_outputs=so),
        metadata=AUTH,
        timeout=300,
    )
    (c,) = r.completions
    assert c.finish_reason == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads(c.text), schema)
    so = pb.StructuredOutputs(choice=["yes", "no"])
    texts = ["", ""]
    stream = stub.GenerateStream(
        req("Is the sky blue?", n=2, temperature=1, seed=1, max_tokens=5, structured_outputs=so),
        metadata=AUTH,
        timeout=300,
    )
    for msg in stream:
        for c in msg.completions:
            texts[c.index] += c.text
    assert all(t in ("yes", "no") for t in texts), texts


# ---- errors ---------------------------------------------------------------------------------
INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_REQUESTS = [
    # (request, param)
    (pb.GenerateRequest(max_tokens=4), "prompt"),
    (pb.GenerateRequest(text=""), "prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), "prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**9])), "prompt"),
    (req("hi", temperature=-1), "temperature"),
    (req("hi", top_p=1.5), "top_p"),
    (req("hi", top_p=0), "top_p"),
    (req("hi", top_k=-5), "top_k"),
    (req("hi", min_p=2), "min_p"),
    (req("hi", n=0), "n"),
    (req("hi", n=1000), "n"),
    (req("hi", max_tokens=0), "max_tokens"),
    (req("hi", max_tokens=10**6), "max_tokens"),
    (req("hi " * 4000), "max_tokens"),
    (req("hi", logprobs=50), "logprobs"),
    (req("hi", frequency_penalty=5), "frequency_penalty"),
    (req("hi", presence_penalty=-3), "presence_penalty"),
    (req("hi", repetition_penalty=0), "repetition_penalty"),
    (req("hi", stop=[""]), "stop"),
    (req("hi", stop_token_ids=[10**9]), "stop_token_ids"),
    (req("hi", min_tokens=5, max_tokens=2), "min_tokens"),
    (req("hi", structured_outputs=pb.StructuredOutputs(regex="a(b")), "structured_outputs.regex"),
    (
        req("hi", structured_outputs=pb.StructuredOutputs(json='{"not": {}}')),
        "structured_outputs.json",
    ),
    (
        req("hi", structured_outputs=pb.StructuredOutputs(regex="a", choice=["a"])),
        "structured_outputs",
    ),
]


@pytest.mark.parametrize(("request_", "param"), BAD_REQUESTS)
def test_bad_requests(stub, request_, param):
    calls = [
        lambda: stub.Generate(request_, metadata=AUTH, timeout=30),
        lambda: list(stub.GenerateStream(request_, metadata=AUTH, timeout=30)),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == INVALID, e.value.details()
        assert e.value.details().startswith(param), e.value.details()
        assert dict(e.value.trailing_metadata())["error-param"] == param


def test_detokenize_bad_ids_and_duplicate_request_id(server, stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Detokenize(pb.DetokenizeRequest(token_ids=[10**9]), metadata=AUTH)
    assert e.value.code() == INVALID and e.value.details().startswith("token_ids")
    stream = stub.GenerateStream(req("Same id:", request_id="dup", **LONG), metadata=AUTH)
    next(stream)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(req("Same id again:", request_id="dup"), metadata=AUTH, timeout=30)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stream.cancel()
    wait_idle(server)


def test_api_key(server, stub):
    labels = {"protocol": "grpc", "status": "UNAUTHENTICATED"}
    before = metric(server.url, "pagedserve_requests_total", labels)
    for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)]:
        for call in (
            lambda md: stub.Generate(req("hi", max_tokens=1), metadata=md, timeout=10),
            lambda md: stub.ModelInfo(pb.ModelInfoRequest(), metadata=md, timeout=10),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call(metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The health service stays open, like HTTP's /health.
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
    assert metric(server.url, "pagedserve_requests_total", labels) - before == 6


def test_metrics_count_grpc(server):
    ok = {"protocol": "grpc", "endpoint": f"/{SERVICE}/Generate", "status": "OK"}
    assert metric(server.url, "pagedserve_requests_total", ok) > 0
    ok["endpoint"] = f"/{SERVICE}/GenerateStream"
    assert metric(server.url, "pagedserve_requests_total", ok) > 0
    bad = {"protocol": "grpc", "status": "INVALID_ARGUMENT"}
    assert metric(server.url, "pagedserve_requests_total", bad) >= len(BAD_REQUESTS)
    grpc_finished = {"protocol": "grpc", "finish_reason": "length"}
    assert metric(server.url, "pagedserve_request_finished_total", grpc_finished) > 0
    assert metric(server.url, "pagedserve_request_generation_tokens_total", {"protocol": "grpc"})
    assert metric(server.url, "pagedserve_time_to_first_token_seconds_count", {"protocol": "grpc"})


def test_sigterm_drains_grpc_then_exits_zero(server):
    """Last test of the module: it shuts the server down."""
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        stream = stub.GenerateStream(
            req("Describe a forest:", max_tokens=60, temperature=0, ignore_eos=True),
            metadata=AUTH,
            timeout=120,
        )
        first = next(stream)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        code = None
        while time.monotonic() < deadline:
            try:
                stub.ModelInfo(pb.ModelInfoRequest(), metadata=AUTH, timeout=5)
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNAVAILABLE:
                    break
            time.sleep(0.1)
        assert code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(req("too late", max_tokens=2), metadata=AUTH, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in e.value.details()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the readiness poll notices within 0.1 s
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.1)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        rest = list(stream)  # the stream in flight finishes normally
    deltas = [d for m in [first, *rest] for d in m.completions]
    assert sum(len(d.token_ids) for d in deltas) == 60
    assert deltas[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert server.proc.wait(60) == 0
