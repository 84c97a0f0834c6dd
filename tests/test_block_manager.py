from pagedserve.block_manager import BlockManager
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, str(seq_id), 0, list(tokens), SamplingParams(), max_tokens=16)


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What the engine does around a step: pages for n tokens, then mark them computed."""
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_pages(seq)


def test_pages_taken_as_sequence_grows_and_returned_on_free():
    bm = BlockManager(num_pages=8, page_size=4)
    seq = make_seq(list(range(10)))
    compute(bm, seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_pages == 5
    seq.output_token_ids.append(99)
    compute(bm, seq, 1)  # token 11 fits the third page
    assert len(seq.block_table) == 3
    seq.output_token_ids += [1, 2]
    compute(bm, seq, 2)  # tokens 12-13 need a fourth page
    assert len(seq.block_table) == 4 and bm.num_free_pages == 4
    bm.free(seq)
    assert bm.num_free_pages == 8 and seq.block_table == []


def test_allocation_fails_without_side_effects_when_pool_is_full():
    bm = BlockManager(num_pages=2, page_size=4)
    a = make_seq(list(range(8)), 0)
    compute(bm, a, 8)
    b = make_seq(list(range(100, 104)), 1)
    assert not bm.allocate(b, 4)
    assert b.block_table == [] and bm.num_free_pages == 0


def test_shared_prefix_pages_are_reused_and_refcounted():
    bm = BlockManager(num_pages=10, page_size=4)
    prompt = list(range(12))
    a = make_seq(prompt, 0)
    compute(bm, a, 12)
    b = make_seq(prompt + [50, 51], 1)
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table  # all three full pages match
    assert bm.allocate(b, 2, cached)
    assert b.num_computed_tokens == 0  # progress is the scheduler's to count
    assert b.block_table[:3] == a.block_table and len(b.block_table) == 4
    assert all(bm.pages[p].ref_count == 2 for p in a.block_table)
    bm.free(a)
    assert all(bm.pages[p].ref_count == 1 for p in b.block_table[:3])
    bm.free(b)
    assert bm.num_free_pages == 10


def test_last_token_is_always_computed():
    bm = BlockManager(num_pages=10, page_size=4)
    a = make_seq(list(range(8)), 0)
    compute(bm, a, 8)
    b = make_seq(list(range(8)), 1)
    assert len(bm.find_cached_prefix(b)) == 1  # the second page holds the last token


def test_different_prefix_does_not_match_later_pages():
    bm = BlockManager(num_pages=10, page_size=4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 0)
    compute(bm, a, 9)
    b = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], 1)  # first page differs, second page equal
    assert bm.find_cached_prefix(b) == []


def test_cached_free_pages_are_evicted_lru_when_needed():
    bm = BlockManager(num_pages=4, page_size=4)
    a = make_seq(list(range(9)), 0)
    compute(bm, a, 9)
    bm.free(a)
    assert bm.num_free_pages == 4 and bm.num_cached_pages == 2
    again = make_seq(list(range(9)), 1)
    assert len(bm.find_cached_prefix(again)) == 2
    other = make_seq(list(range(100, 116)), 2)
    compute(bm, other, 16)  # needs all four pages: the cached ones are evicted
    assert bm.num_cached_pages == 4  # other's four full pages
    assert bm.find_cached_prefix(again) == []
    bm.free(other)
    assert bm.reset_prefix_cache() and bm.num_cached_pages == 0


def test_only_newly_filled_pages_are_offered_to_the_prefix_cache():
    bm = BlockManager(num_pages=8, page_size=4)
    seq = make_seq(list(range(9)))
    compute(bm, seq, 9)
    assert seq.num_registered_pages == 2 and bm.num_cached_pages == 2
    seq.output_token_ids += [7, 8, 9]
    compute(bm, seq, 3)
    assert seq.num_registered_pages == 3
    hashes = [bm.pages[p].block_hash for p in seq.block_table]
    assert None not in hashes
    bm.free(seq)
    assert seq.num_registered_pages == 0 and bm.num_cached_pages == 3
