"""Paged varlen prefill attention in Triton: query chunks after cached context, causal."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.attention.triton_common import (
    LOG2E,
    PREFILL_BLOCK_M,
    PREFILL_BLOCK_N,
    attend_tiles,
    check_cache,
    dot_precision,
    rows,
    upcast_dot,
)

# ---- prefill -------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    q_starts_ptr,
    q_lens_ptr,
    context_lens_ptr,
    out_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cpage,
    stride_cslot,
    stride_chead,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: BLOCK_M (query, head-in-group) rows of one sequence and one KV head.

    Rows are laid out query-major (row = query * GROUP + head), so the GROUP heads sharing a KV
    head read each K/V tile once, whatever GROUP is (3 is as good as 4).
    """
    b = tl.program_id(0).to(tl.int64)
    row_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + b)
    first_row = row_block * BLOCK_M
    if first_row >= q_len * GROUP:
        return
    ctx = tl.load(context_lens_ptr + b)
    prefix = ctx - q_len  # tokens already in pages before this chunk
    q_start = tl.load(q_starts_ptr + b).to(tl.int64)

    rows = first_row + tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    mask = (rows < q_len * GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=mask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + qi
    # Causal: the last query of this block sees keys up to its own position.
    last_q = tl.minimum((first_row + BLOCK_M - 1) // GROUP, q_len - 1)
    end = prefix + last_q + 1
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, m_i, l_i = attend_tiles(
        q,
        q_pos,
        acc,
        m_i,
        l_i,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + b * stride_bt,
        kv_head,
        0,
        end,
        qk_scale,
        stride_cpage,
        stride_cslot,
        stride_chead,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        PAGE_SIZE,
        True,
        UPCAST,
        PRECISION,
    )
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_q_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch of chunks over their pages.

    q: [Tp, num_heads, head_dim], the chunks back to back (chunk i starts at q_starts[i] and has
    q_lens[i] tokens). Chunk i's tokens sit at positions context_lens[i] - q_lens[i] onwards, and
    their K/V must already be in the pages: each query attends to the cached prefix and to the
    chunk's tokens up to itself.
    """
    check_cache(k_cache)
    tp, num_heads, d = q.shape
    _, page_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    q = rows(q)
    if out is None:
        out = torch.empty_like(q)
    bp = q_lens.shape[0]
    if tp == 0 or bp == 0:
        return out
    grid = (bp, triton.cdiv(max_q_len * group, PREFILL_BLOCK_M), kvh)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        q_starts,
        q_lens,
        context_lens,
        out,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=PREFILL_BLOCK_N,
        PAGE_SIZE=page_size,
        UPCAST=upcast_dot(q.dtype),
        PRECISION=dot_precision(q.dtype),
        num_warps=4,
    )
    return out
