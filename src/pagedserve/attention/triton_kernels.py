"""Triton kernels for paged attention: the KV write, decode (plain and split-K), varlen prefill.

All attention kernels read K/V straight from the pages through the block table, one key tile
at a time, with an online softmax (FlashAttention): the attention matrix is never materialised
and each K/V row is read once per KV head. A key's page is looked up per key
(`block_table[pos // PAGE_SIZE]`), so the key tile size does not have to match the page size.

Caches are [num_pages, page_size, num_kv_heads, head_dim]; the first two dims must be contiguous
with each other so that a flat slot (page * page_size + offset) addresses a row.

On CPU these run under Triton's interpreter (TRITON_INTERPRET=1, set before this module is
imported) for testing; the torch backend is the reference they are checked against.

The kernels live in triton_common.py (KV write, the shared inner loop), triton_decode.py and
triton_prefill.py; this module is their one entry point.
"""

from pagedserve.attention.triton_common import _kv_write_kernel, interpreting, write_kv
from pagedserve.attention.triton_decode import (
    _decode_kernel,
    _split_reduce_kernel,
    choose_num_splits,
    paged_decode_attention,
)
from pagedserve.attention.triton_prefill import _prefill_kernel, paged_prefill_attention

__all__ = [
    "_decode_kernel",
    "_kv_write_kernel",
    "_prefill_kernel",
    "_split_reduce_kernel",
    "choose_num_splits",
    "interpreting",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv",
]
