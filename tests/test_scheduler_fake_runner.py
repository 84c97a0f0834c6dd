"""Scheduler, block manager and the real ModelRunner driven by a fake model (no weights).

The fake model stores each token and its position in the KV slot the runner chose, and makes
every token's "next token" a hash of the context it reads back through the block tables. So
any wrong slot, page, position or layout changes the outputs, which must equal those of a
plain loop over whole sequences: under chunked prefill, preemption and prefix caching alike.
"""

import pytest
import torch

from pagedserve.block_manager import BlockManager
from pagedserve.model_runner import ModelRunner
from pagedserve.models.config import ModelConfig
from pagedserve.sampler import sample
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler
from pagedserve.sequence import Sequence, SequenceStatus

VOCAB = 97


def next_token(context: list[int]) -> int:
    return sum((i + 1) * t for i, t in enumerate(context)) % VOCAB


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class NoBackend:
    name = "none"

    def prepare(self, meta, page_size, num_q_per_kv) -> None:
        pass


class FakeModel(torch.nn.Module):
    """K holds (token, position) per slot; the hidden state is a one-hot next token."""

    def __init__(self, page_size: int):
        super().__init__()
        self.page_size = page_size

    def forward(self, input_ids, positions, kv_caches, meta):
        k_cache = kv_caches[0][0]
        slots = k_cache.view(-1, 2)
        slots[meta.slot_mapping] = torch.stack([input_ids, positions], 1).float()
        # Each token's row, block table and context length, in the decodes-first layout.
        nd = meta.num_decode_tokens
        rows = [(meta.decode_block_tables[r], int(meta.decode_context_lens[r])) for r in range(nd)]
        for r, q in enumerate(meta.prefill_q_lens.tolist()):
            table, ctx = meta.prefill_block_tables[r], int(meta.prefill_context_lens[r])
            rows += [(table, ctx - q + j + 1) for j in range(q)]
        assert len(rows) == len(input_ids)
        hidden = torch.zeros(len(input_ids), VOCAB)
        for t, (table, ctx) in enumerate(rows):
            pos = torch.arange(ctx)
            read = slots[table[pos // self.page_size] * self.page_size + pos % self.page_size]
            assert read[:, 1].tolist() == pos.tolist(), "a slot holds another position"
            assert int(read[-1, 1]) == int(positions[t])
            hidden[t, next_token([int(x) for x in read[:, 0].tolist()])] = 1.0
        return hidden

    def compute_logits(self, hidden):
        return hidden


def make_runner(num_pages: int, page_size: int) -> ModelRunner:
    cfg = ModelConfig("Fake", VOCAB, 2, 2, 1, 1, 1, 2, 1e-6, 1e4, None, 4096, True, False, [], None)
    return ModelRunner(
        FakeModel(page_size), cfg, NoBackend(), num_pages, page_size, torch.float32,
        torch.device("cpu"),
    )  # fmt: skip


def run(prompts, max_tokens, num_pages, page_size=4, budget=16, max_seqs=8, prefix=True):
    """The engine's loop (schedule, execute, sample, append, finish) on the fake model."""
    bm = BlockManager(num_pages, page_size, prefix)
    sched = Scheduler(bm, budget, max_seqs)
    runner = make_runner(num_pages, page_size)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    seqs = [Sequence(i, str(i), 0, p, params, max_tokens=max_tokens) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_work:
        steps += 1
        assert steps < 10_000
        out = sched.schedule()
        assert out.num_tokens <= budget
        sample_rows = [i for i, s in enumerate(out.scheduled) if s.samples]
        logits = runner.execute(out, sample_rows)
        sched.after_step(out)
        sampled = [out.scheduled[i].seq for i in sample_rows]
        for seq, token in zip(sampled, sample(logits, sampled, []).token_ids, strict=True):
            seq.output_token_ids.append(token)
            if len(seq.output_token_ids) >= max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    assert bm.num_used_pages == 0
    return [s.output_token_ids for s in seqs], sched.num_preemptions


PROMPTS = [[(7 * r + i) % VOCAB for i in range(5 + 3 * r)] for r in range(6)]


def test_outputs_equal_the_plain_loop_with_room_to_spare():
    outputs, preemptions = run(PROMPTS, 12, num_pages=64)
    assert outputs == [reference(p, 12) for p in PROMPTS]
    assert preemptions == 0


def test_outputs_survive_preemption_and_chunked_prefill():
    outputs, preemptions = run(PROMPTS, 20, num_pages=14, budget=6)
    assert preemptions > 0
    assert outputs == [reference(p, 20) for p in PROMPTS]


@pytest.mark.parametrize("prefix", [True, False])
def test_shared_prefixes_reuse_pages_without_changing_outputs(prefix):
    shared = [3, 1, 4, 1, 5, 9, 2, 6]  # two full pages
    prompts = [shared + [r, r + 1] for r in range(4)] + [shared]
    outputs, _ = run(prompts, 6, num_pages=40, budget=64, prefix=prefix)
    assert outputs == [reference(p, 6) for p in prompts]
