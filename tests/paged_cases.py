"""Paged KV pools and step metadata shared by the attention tests (Triton and CPU kernels)."""

from __future__ import annotations

import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.int8_pages import to_cache

NUM_KV_HEADS = 2


class Pool:
    """A KV pool with each sequence's pages scattered at random, tables padded with page 0."""

    def __init__(self, context_lens, page_size, head_dim, dtype, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.page_size = page_size
        need = [-(-n // page_size) for n in context_lens]
        num_pages = sum(need) + 3  # spare pages that no table points at
        perm = torch.randperm(num_pages, generator=self.gen).tolist()
        self.tables, at = [], 0
        for n in need:
            self.tables.append(perm[at : at + n])
            at += n
        width = max(need)
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables])
        shape = (num_pages, page_size, NUM_KV_HEADS, head_dim)
        # Random data everywhere, stale slots included: masking must ignore them.
        self.k = to_cache(torch.randn(shape, generator=self.gen), dtype)
        self.v = to_cache(torch.randn(shape, generator=self.gen), dtype)

    def slots(self, seq: int, start: int, stop: int) -> list[int]:
        ps = self.page_size
        return [self.tables[seq][p // ps] * ps + p % ps for p in range(start, stop)]

    def randn(self, *shape, dtype):
        return torch.randn(shape, generator=self.gen).to(dtype)


def make_meta(
    pool: Pool, q_lens: list[int], context_lens: list[int], write: bool = True
) -> AttentionMetadata:
    """Metadata as the model runner lays it out: decodes (q_len 1) first, then chunks.

    `write=False`: no new K/V to write, the kernels under test read the pool as it is.
    """
    nd = sum(1 for n in q_lens if n == 1)
    assert all(n == 1 for n in q_lens[:nd]) and all(n > 1 for n in q_lens[nd:])
    slots = []
    for i, (n, c) in enumerate(zip(q_lens, context_lens, strict=True)):
        slots += pool.slots(i, c - n, c) if write else []
    ctx = torch.tensor(context_lens)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decode_tokens=nd,
        decode_block_tables=pool.block_tables[:nd],
        decode_context_lens=ctx[:nd],
        prefill_q_lens=torch.tensor(q_lens[nd:], dtype=torch.long),
        prefill_context_lens=ctx[nd:],
        prefill_block_tables=pool.block_tables[nd:],
        prefill_max_q_len=max(q_lens[nd:], default=0),
    )
