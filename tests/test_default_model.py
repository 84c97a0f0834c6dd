"""Greedy parity with transformers on the real default model, in every scheduling regime."""

from __future__ import annotations

import pytest

from conftest import PROMPTS, TOP, agreeing_prefix, assert_pool_whole, hf_greedy
from pagedserve import LLM, SamplingParams, detokenizer

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def expected(llm, hf_reference):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    return [hf_greedy(hf_reference, i, MAX_TOKENS) for i in ids]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_one_at_a_time(llm, expected):
    got = [token_ids(llm.generate([p], GREEDY))[0] for p in PROMPTS]
    assert got == expected
    assert_pool_whole(llm.engine)


def test_all_at_once(llm, expected):
    outputs = llm.generate(PROMPTS, GREEDY)
    assert token_ids(outputs) == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    texts = [o.outputs[0].text for o in outputs]
    assert texts == [llm.tokenizer.decode(e, skip_special_tokens=True) for e in expected]
    assert_pool_whole(llm.engine)


def test_chunked_prefill(expected):
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=4)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    assert_pool_whole(llm.engine)


def test_preemption(expected):
    # 10 pages of 16 tokens: the 8 sequences need 3 pages each by the end.
    llm = LLM(dtype="float32", kv_cache_memory=10 * 737280, enable_prefix_caching=False)
    assert llm.engine.block_manager.num_pages == 10
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_whole(llm.engine)


def test_int8_pages_fit_more_and_survive_preemption_and_chunks():
    # float32 pages: 737280 bytes; int8 ones hold 64 codes and a 4-byte scale per head row.
    int8_page = 737280 * 68 // (64 * 4)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)

    def run(llm: LLM) -> list[dict]:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        assert_pool_whole(llm.engine)
        return [{"ids": o.token_ids, "logprobs": o.logprobs} for o in outs]

    roomy = LLM(dtype="float32", kv_cache_dtype="int8", kv_cache_memory=10 * 737280)
    assert roomy.engine.block_manager.num_pages == 10 * 737280 // int8_page == 37
    tight = LLM(
        dtype="float32",
        kv_cache_dtype="int8",
        kv_cache_memory=10 * int8_page,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    assert tight.engine.block_manager.num_pages == 10
    # Recomputed or chunked, a key can round to the neighbouring int8 code: outputs close
    # in vLLM's sense rather than equal.
    agree = [agreeing_prefix(t, r) for t, r in zip(run(tight), run(roomy), strict=True)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert sum(a == MAX_TOKENS for a in agree) >= len(PROMPTS) // 2, agree


def test_eos_stops_and_chat_template(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0))
    assert out[0].outputs[0].finish_reason in ("stop", "length")
    out = llm.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200)
    )
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] == llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "<|im_end|>" not in completion.text


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = llm.generate(["The weather today"], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.2, max_tokens=20)
    batch = llm.generate(["Hello", "The weather today", "Numbers:"], [others, params, others])
    assert batch[1].outputs[0].token_ids == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16)
    assert llm.generate(["The weather today"], different)[0].outputs[0].token_ids != alone
    assert_pool_whole(llm.engine)


def test_stop_string_split_across_tokens(llm):
    full = llm.generate(["Once upon a time"], GREEDY)[0].outputs[0]
    tok = llm.tokenizer
    # A stop string that starts inside one token and ends inside the next.
    pieces = [tok.decode(full.token_ids[: i + 1], skip_special_tokens=True) for i in range(10)]
    boundary = next(len(pieces[i]) for i in range(3, 10) if len(pieces[i + 1]) - len(pieces[i]) > 1)
    stop = full.text[boundary - 2 : boundary + 2]
    assert len(stop) == 4
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop])
    out = llm.generate(["Once upon a time"], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert_pool_whole(llm.engine)


def test_stop_token_ids_and_n(llm):
    full = llm.generate(["1, 2, 3, 4,"], GREEDY)[0].outputs[0]
    stop_id = full.token_ids[5]
    out = llm.generate(
        ["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert out.stop_reason == stop_id
    many = llm.generate(["Tell me a story"], SamplingParams(n=3, temperature=1.0, max_tokens=8))
    assert [c.index for c in many[0].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in many[0].outputs)
    assert_pool_whole(llm.engine)


def test_logprobs_are_those_of_the_model(llm, hf_reference):
    import torch

    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    out = llm.generate(["The capital of France is"], params)[0]
    first = out.outputs[0].logprobs[0]
    assert len(first) == 3 and out.outputs[0].token_ids[0] in first
    with torch.no_grad():
        logits = hf_reference(torch.tensor([out.prompt_token_ids])).logits[0, -1]
    ref = torch.log_softmax(logits, -1).topk(3)
    for tid, val in zip(ref.indices.tolist(), ref.values.tolist(), strict=True):
        assert first[tid] == pytest.approx(val, abs=1e-3)


def test_invalid_requests_raise_clear_errors(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(["hi"], SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams())
    assert_pool_whole(llm.engine)


def test_decoder_reads_the_rust_tokenizer_only_where_transformers_would(llm):
    tok = llm.tokenizer
    ids = tok.encode("Hello, wörld! 日本 ...") + [tok.eos_token_id]
    fast = detokenizer.decoder(tok)
    assert fast.func == tok.backend_tokenizer.decode
    assert fast(ids) == tok.decode(ids, skip_special_tokens=True)
    tok.clean_up_tokenization_spaces = True  # transformers would edit the text: keep its decode
    try:
        assert detokenizer.decoder(tok).func == tok.decode
    finally:
        tok.clean_up_tokenization_spaces = False
