"""Structured output and tool calling, end to end through the official openai client against
a real server, plus the pieces that need no server (the tool-call parser, the bitmask) and the
engine in process (preemption, a grammar dead end)."""

from __future__ import annotations

import asyncio
import json
import math
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
import torch

from conftest import PROMPTS, assert_pool_whole
from pagedserve.output_stream import RequestStream
from pagedserve.outputs import CompletionDelta, RequestDelta
from pagedserve.structured.bitmask import (
    StepMask,
    allowed_tokens,
    apply_bitmask,
    masked_logits_torch,
    rows_without_tokens,
)
from pagedserve.tools.parser import ToolCallProcessor, parse
from test_server import MODEL, ServerProcess, chat_messages

SCHEMAS = {
    "enum_and_int_range": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 3, "maximum": 7},
        },
        "required": ["color", "count"],
        "additionalProperties": False,
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_min_max": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "ok": {"type": "boolean"},
        },
        "required": ["code", "ok"],
        "additionalProperties": False,
    },
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 100},
                "b": {"type": "integer", "minimum": 0, "maximum": 100},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# ---- no server --------------------------------------------------------------------------
def test_tool_call_parser_streams_what_the_whole_text_parses_to():
    calls = [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
        "\n</tool_call>",
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": [2]}}}\n</tool_call>',
    ]
    text = "Let me look <that> up.\n" + "\n".join(calls) + "\nDone."
    whole = parse(text, final=True)
    assert whole.content == "Let me look <that> up.\nDone."
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("add", {"a": 1, "b": {"c": [2]}}),
    ]
    # Through the chat stream's path: a RequestStream whose output processor parses the calls.
    stream = RequestStream("r", [1], processor=lambda _: ToolCallProcessor())
    content, assembled = "", {}
    for end in range(1, len(text) + 1):  # one character at a time: every cut is exercised
        last = end == len(text)
        piece = CompletionDelta(0, text[end - 1], [end], finish_reason="stop" if last else None)
        (event,) = stream.update([RequestDelta("r", [piece], finished=last)])
        content += event.text
        assert "<tool" not in content and "</" not in content
        for d in event.tool_calls or []:
            if d.index not in assembled:
                assert d.id and d.id.startswith("call_") and d.name
                assembled[d.index] = [d.id, d.name, ""]
            else:
                assert d.id is None and d.name is None
            assembled[d.index][2] += d.arguments
    assert content == whole.content
    assert [(n, a) for _, n, a in assembled.values()] == [
        (c.name, c.arguments) for c in whole.calls
    ]
    (out,) = stream.outputs
    assert out.finish_reason == "tool_calls" and out.text == whole.content
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [
        tuple(v) for v in assembled.values()
    ]


def test_unfinished_tool_call_is_not_content():
    assert parse('Hi <tool_call>\n{"name": "add", "argu', final=True).content == "Hi "
    assert parse("Hi <tool_ca", final=False).content == "Hi "
    assert parse("Hi <tool_ca", final=True).content == "Hi <tool_ca"


def test_bitmask_masks_constrained_rows_only():
    logits = torch.randn(3, 70)
    bits = torch.zeros(1, 3, dtype=torch.int32)
    bits[0, 0] = 1 << 5  # token 5
    bits[0, 2] = 1 << 1  # token 65
    mask = StepMask(torch.tensor([1]), bits)
    for out in apply_bitmask(logits, mask), masked_logits_torch(logits, mask):
        assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
        assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [5, 65]
    assert allowed_tokens(torch.tensor([[-1]], dtype=torch.int32), 32).all()


def test_a_dead_end_row_is_found_by_its_best_token():
    logits = torch.randn(3, 64)
    bits = torch.zeros(2, 2, dtype=torch.int32)
    bits[1, 1] = 1 << 3  # row 2 may say token 35 only; row 0 nothing
    mask = StepMask(torch.tensor([0, 2]), bits)
    masked = apply_bitmask(logits, mask)
    best = masked.argmax(dim=-1)
    assert best[2] == 35
    assert rows_without_tokens(masked, best, mask) == [0]


# ---- the engine in process ----------------------------------------------------------------
@pytest.fixture(scope="module")
def small_engine():
    from pagedserve.config import EngineConfig
    from pagedserve.engine import LLMEngine

    # 12 pages of 16 tokens: eight ~40-token sequences cannot all hold their pages at once.
    return LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="9MiB", num_threads=1, seed=0))


def _run(engine, prompts, params) -> list:
    streams = {}
    for i, p in enumerate(prompts):
        state = engine.add_request(f"r{i}", p, params)
        streams[state.request_id] = RequestStream(
            state.request_id, state.prompt_token_ids, params.n
        )
    while engine.has_unfinished_requests():
        for delta in engine.step():
            streams[delta.request_id].update([delta])
    return [streams[f"r{i}"].output() for i in range(len(prompts))]


def test_preemption_keeps_each_sequence_grammar(small_engine):
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.structured.spec import StructuredSpec

    schema = SCHEMAS["array_min_max"]
    params = SamplingParams(
        temperature=0, max_tokens=60, structured=StructuredSpec.json_schema(schema)
    )
    prompts = [f"{p} Answer as JSON with tags." for p in PROMPTS]
    before = small_engine.scheduler.num_preemptions
    outs = _run(small_engine, prompts, params)
    assert small_engine.scheduler.num_preemptions > before, "the pool was meant to preempt"
    for out in outs:
        (o,) = out.outputs
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), schema)
    solo = _run(small_engine, prompts[:1], params)[0].outputs[0].text
    assert outs[0].outputs[0].text == solo
    assert_pool_whole(small_engine)


def test_grammar_dead_end_finishes_cleanly(small_engine):
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.structured.spec import StructuredSpec

    # The choice is complete after "yes"; min_tokens then forbids the only token left (EOS).
    params = SamplingParams(
        temperature=0, max_tokens=20, min_tokens=8, structured=StructuredSpec.choice(["yes"])
    )
    (out,) = _run(small_engine, ["Say yes."], params)
    assert out.outputs[0].finish_reason == "grammar_dead_end"
    assert out.outputs[0].text == "yes"
    assert_pool_whole(small_engine)


# ---- a real server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("structured-logs") / "server.log")
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _json_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


class Person(pydantic.BaseModel):
    name: str
    age: int
    city: str


def test_parse_into_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=chat_messages("Describe a person who lives in Rome, as JSON."),
        response_format=Person,
        temperature=0,
        max_tokens=80,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(client, name):
    schema = SCHEMAS[name]
    messages = chat_messages(f"Reply with a JSON object for '{name}'.")
    sampled = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        response_format=_json_format(name, schema),
        n=3,
        temperature=0.9,
        top_p=0.95,
        seed=7,
        max_tokens=150,
    )
    texts = [c.message.content for c in sampled.choices]
    assert all(c.finish_reason == "stop" for c in sampled.choices), sampled
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        response_format=_json_format(name, schema),
        temperature=0,
        max_tokens=150,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    texts.append("".join(c.choices[0].delta.content or "" for c in chunks))
    assert chunks[-1].choices[0].finish_reason == "stop"
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_completions_endpoint(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages('Repeat exactly: {"animal": "cat", "legs": 4}'),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=100,
    )
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    schema = SCHEMAS["enum_and_int_range"]
    completion = client.completions.create(
        model=MODEL,
        prompt="A color and a count as JSON:",
        max_tokens=60,
        temperature=0,
        extra_body={"structured_outputs": {"json": schema}},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


def test_regex_and_choice(client):
    pattern = r"[0-9]{3}-[0-9]{4}"
    for stream in (False, True):
        out = client.completions.create(
            model=MODEL,
            prompt="My phone number is",
            max_tokens=20,
            temperature=0.7,
            seed=3,
            n=2,
            stream=stream,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        texts = ["", ""]
        for c in out if stream else [out]:
            for ch in c.choices:
                texts[ch.index] += ch.text
        assert all(re.fullmatch(pattern, t) for t in texts), texts
    choices = ["positive", "negative", "neutral"]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("Sentiment of 'I love this movie'?"),
        temperature=1.0,
        n=3,
        max_tokens=10,
        logprobs=True,
        top_logprobs=5,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    for c in chat.choices:
        assert c.message.content in choices
        # Logprobs are those of the constrained distribution: only what the grammar allowed.
        first = c.logprobs.content[0]
        assert all(any(x.startswith(t.token) for x in choices) for t in first.top_logprobs)
        assert sum(math.exp(t.logprob) for t in first.top_logprobs) <= 1 + 1e-6


def test_lark_grammar(client):
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]?/'
    out = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("What is 2 + 3?"),
        temperature=0,
        max_tokens=20,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"The answer is [1-9][0-9]?\.", out.choices[0].message.content)


def test_cut_by_max_tokens_is_length_with_text_so_far(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("A person as JSON."),
        response_format=_json_format("nested", SCHEMAS["nested_object"]),
        temperature=0,
        max_tokens=5,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content.startswith("{")
    assert out.usage.completion_tokens == 5


BAD = [
    (
        {"response_format": _json_format("x", {"not": {"type": "string"}})},
        "response_format.json_schema.schema",
        "not",
    ),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "foo"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"tool_choice": "required"}, "tool_choice", "requires tools"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "if": {}}},
                }
            ],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
        "if",
    ),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD, ids=[b[1] for b in BAD])
def test_bad_constraints_are_400_naming_the_field(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=chat_messages("Hi"), max_tokens=5, extra_body=extra
        )
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    assert words in err["message"], err


def _check_calls(calls, names=None) -> None:
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_tool_choice_required_named_and_none(client):
    messages = chat_messages("What is the weather in Paris, and what is 2 + 3?")
    one = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
    )
    choice = one.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls)
    sampled = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        temperature=0.8,
        seed=11,
        n=3,
        max_tokens=200,
    )
    for c in sampled.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        _check_calls(c.message.tool_calls)
    named = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=0,
        max_tokens=60,
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "add" and named.choices[0].finish_reason == "tool_calls"
    _check_calls([call])
    none = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=20
    )
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content


def test_tool_choice_auto_is_a_well_formed_answer(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("Use a tool to add 2 and 3."),
        tools=TOOLS,
        temperature=0,
        max_tokens=80,
    )
    message = out.choices[0].message
    if message.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"
        assert all(c.function.name in TOOL_SCHEMAS for c in message.tool_calls)
    assert "<tool_call>" not in (message.content or "")


def test_streamed_tool_call_deltas_assemble(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("Weather in Oslo and in Lima, please."),
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=200,
        stream=True,
    )
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.function.name and tc.type == "function"
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index]["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls" and calls and content == ""
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), TOOL_SCHEMAS[call["name"]])


def test_tool_result_round_trip(server, client):
    question = chat_messages("What is the weather in Paris?")
    first = client.chat.completions.create(
        model=MODEL,
        messages=question,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    (call,) = first.choices[0].message.tool_calls
    history = [
        *question,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=40
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The history renders in the built-in Hermes format (the default template has no tools).
    r = httpx.post(f"{server.url}/tokenize", json={"messages": history}, timeout=30)
    assert r.status_code == 200, r.text
    tokens = {"tokens": r.json()["tokens"]}
    prompt = httpx.post(f"{server.url}/detokenize", json=tokens, timeout=30).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {' in prompt
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in prompt


def test_16_concurrent_mixed_requests(server, client):
    plain = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    ]
    schema = SCHEMAS["enum_and_int_range"]
    aclient = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300
    )

    async def unconstrained(i: int) -> str:
        out = await aclient.completions.create(
            model=MODEL, prompt=PROMPTS[i], max_tokens=12, temperature=0
        )
        return out.choices[0].text

    async def constrained(i: int) -> str:
        out = await aclient.chat.completions.create(
            model=MODEL,
            messages=chat_messages(PROMPTS[i]),
            response_format=_json_format("mixed", schema),
            temperature=0.5,
            seed=i,
            max_tokens=60,
        )
        return out.choices[0].message.content

    async def main():
        jobs = [unconstrained(i) for i in range(8)] + [constrained(i) for i in range(8)]
        results = await asyncio.gather(*jobs)
        await aclient.close()
        return results

    results = asyncio.run(main())
    assert results[:8] == plain
    for text in results[8:]:
        jsonschema.validate(json.loads(text), schema)
