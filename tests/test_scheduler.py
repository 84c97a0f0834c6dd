from pagedserve.block_manager import BlockManager
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler
from pagedserve.sequence import Sequence, SequenceStatus


def make_seq(seq_id: int, n_prompt: int, max_tokens: int = 8) -> Sequence:
    prompt = [seq_id * 1000 + i for i in range(n_prompt)]
    return Sequence(seq_id, str(seq_id), 0, prompt, SamplingParams(), max_tokens=max_tokens)


def run_step(s: Scheduler, max_tokens: int | None = None):
    """Schedule, pretend the model ran, append a token to each sampling sequence."""
    out = s.schedule()
    assert out.num_tokens <= s.max_num_batched_tokens
    assert len(out.scheduled) <= s.max_num_seqs
    sampled = [x.seq for x in out.scheduled if x.samples]
    s.after_step(out)
    for seq in sampled:
        seq.output_token_ids.append(7)
        if len(seq.output_token_ids) >= (max_tokens or seq.max_tokens):
            s.finish(seq, SequenceStatus.FINISHED_LENGTH)
    return out, sampled


def test_fcfs_admission_within_budget_and_chunked_prefill():
    s = Scheduler(BlockManager(64, 4), max_num_batched_tokens=10, max_num_seqs=8)
    a, b, c = make_seq(1, 6), make_seq(2, 6), make_seq(3, 3)
    for q in (a, b, c):
        s.add(q)
    out, sampled = run_step(s)
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(a, 6), (b, 4)]
    assert sampled == [a]  # b is mid-prefill
    out, sampled = run_step(s)
    # a decodes one token, b finishes its prompt (2), c is admitted whole (3)
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(a, 1), (b, 2), (c, 3)]
    assert sampled == [a, b, c]


def test_max_num_seqs_limits_running():
    s = Scheduler(BlockManager(64, 4), max_num_batched_tokens=100, max_num_seqs=2)
    seqs = [make_seq(i, 2) for i in range(4)]
    for q in seqs:
        s.add(q)
    out, _ = run_step(s)
    assert [x.seq for x in out.scheduled] == seqs[:2]
    assert list(s.waiting) == seqs[2:]


def test_preemption_frees_newest_and_recomputes_it_later():
    bm = BlockManager(num_pages=4, page_size=4)
    s = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    a, b = make_seq(1, 4, max_tokens=9), make_seq(2, 4, max_tokens=9)
    s.add(a)
    s.add(b)
    for _ in range(5):  # each computes 8 tokens: two pages each, the pool is full
        out, _ = run_step(s)
        assert not out.preempted
    assert bm.num_free_pages == 0 and a.num_computed_tokens == b.num_computed_tokens == 8
    out, _ = run_step(s)  # a's 9th token needs a third page: b, the newest, is preempted
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.block_table == []
    assert b.num_computed_tokens == 0 and s.num_preemptions == 1
    steps = 0
    while s.has_work:
        run_step(s)
        steps += 1
        assert steps < 50
    assert len(a.output_token_ids) == 9 and len(b.output_token_ids) == 9
    assert bm.num_free_pages == 4


def test_budget_never_exceeded_under_mixed_load():
    bm = BlockManager(num_pages=40, page_size=4)
    s = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=5)
    for i in range(12):
        s.add(make_seq(i, 3 + 5 * (i % 4), max_tokens=5))
    steps = 0
    while s.has_work:
        run_step(s)  # asserts the budget and seq limit each step
        steps += 1
        assert steps < 500
    assert bm.num_free_pages == 40
