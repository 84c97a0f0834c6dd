"""Automatic prefix caching on the default model: same outputs, less prompt computed."""

from __future__ import annotations

import pytest

from conftest import assert_pool_whole
from pagedserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant for a library. You answer questions about opening hours, "
    "borrowing rules, late fees, the reading rooms and the archive. Be brief and precise, "
    "and when you do not know something, say so and suggest asking the front desk. "
)


@pytest.fixture(scope="module")
def cached():
    return LLM(dtype="float32", kv_cache_memory="32MiB")


@pytest.fixture(scope="module")
def uncached():
    return LLM(dtype="float32", kv_cache_memory="32MiB", enable_prefix_caching=False)


def test_outputs_identical_with_and_without_cache(cached, uncached):
    tok = cached.tokenizer
    base = tok.encode(SYSTEM)
    assert len(base) > 3 * 16
    prompts = [
        base[:5] + [tok.encode(" zebra")[0]],  # shares less than one page
        base[:20] + tok.encode(" Question: when do you open?"),  # shares one page
        base + tok.encode(" Question: what are the late fees?"),  # shares many pages
        base + tok.encode(" Question: can I borrow maps?"),
        list(base[:48]),  # whole prompt is full pages, all shared with the earlier ones
        list(base[:48]),  # identical to the previous one
    ]
    # Sequentially, so that each request can find what the earlier ones left cached.
    with_cache = [cached.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    without = [o.outputs[0].token_ids for o in uncached.generate(prompts, GREEDY)]
    assert with_cache == without
    assert cached.engine.block_manager.prefix_stats.hits > 0
    assert uncached.engine.block_manager.prefix_stats.hits == 0
    assert_pool_whole(cached.engine)
    assert_pool_whole(uncached.engine)


def test_second_identical_request_computes_at_most_one_page(cached):
    prompt = SYSTEM + "Question: is there parking?"
    first = cached.generate([prompt], GREEDY)[0]
    n_prompt = len(first.prompt_token_ids)
    before = cached.engine.counters.prompt_tokens
    second = cached.generate([prompt], GREEDY)[0]
    computed = cached.engine.counters.prompt_tokens - before
    assert computed <= cached.engine.block_manager.page_size
    assert second.metrics.num_cached_tokens == n_prompt - computed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_pool_whole(cached.engine)


def test_concurrent_requests_with_same_new_prefix(cached, uncached):
    prompts = [SYSTEM + f"Question {i}: where are the toilets?" for i in range(6)]
    together = [o.outputs[0].token_ids for o in cached.generate(prompts, GREEDY)]
    reference = [o.outputs[0].token_ids for o in uncached.generate(prompts, GREEDY)]
    assert together == reference
    assert_pool_whole(cached.engine)


def test_eviction_keeps_serving_and_forgets_old_prefixes():
    # 8 pages of 16 tokens: room for about one long prompt's pages at a time.
    llm = LLM(dtype="float32", kv_cache_memory=8 * 737280)
    stats = llm.engine.block_manager.prefix_stats
    prompt = SYSTEM[:200]
    first = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    hits = stats.hits
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == first
    assert stats.hits > hits  # re-sent before eviction: hit
    others = [f"Story number {i}: the dragon and the {w}" * 4 for i, w in enumerate("abcdef")]
    for other in others:
        llm.generate([other], GREEDY)
    hits = stats.hits
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == first
    assert stats.hits == hits  # evicted meanwhile: no hit, same answer
    assert_pool_whole(llm.engine)


def test_prefix_cache_with_chunked_prefill_and_preemption(uncached):
    llm = LLM(
        dtype="float32", kv_cache_memory=10 * 737280, max_num_batched_tokens=24, max_num_seqs=4
    )
    prompts = [SYSTEM[:150] + f" Item {i}." for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in uncached.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_stats.hits > 0
    assert_pool_whole(llm.engine)
