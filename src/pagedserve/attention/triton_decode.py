"""Paged decode attention in Triton: one query token per sequence, plain or split-K."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.attention.triton_common import (
    DECODE_BLOCK_N,
    LOG2E,
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    attend_tiles,
    check_cache,
    dot_precision,
    rows,
    upcast_dot,
)

# ---- decode --------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    keys_per_split,
    stride_qb,
    stride_qh,
    stride_cpage,
    stride_cslot,
    stride_chead,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: one sequence, one KV head with its GROUP query heads, one key split."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    start = split * keys_per_split
    end = tl.minimum(ctx, start + keys_per_split)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    qmask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    acc, m_i, l_i = attend_tiles(
        q,
        g,  # unused: no causal mask for the single query
        acc,
        m_i,
        l_i,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + b * stride_bt,
        kv_head,
        start,
        end,
        qk_scale,
        stride_cpage,
        stride_cslot,
        stride_chead,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        PAGE_SIZE,
        False,
        UPCAST,
        PRECISION,
    )
    # An empty split (start >= ctx) has l_i == 0: it stores zeros and an lse of -inf.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if SPLIT:
        tl.store(o_ptrs + split * stride_os, out, mask=qmask)
        # l_i >= 1 when the split saw keys (its max scores 2^0); an empty split stays -inf.
        lse = m_i + tl.log2(tl.maximum(l_i, 1.0))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g < GROUP)
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _split_reduce_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Merge the splits of one (sequence, head): weights 2^(lse_s - max lse)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < num_splits
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    mask = smask[:, None] & (d < HEAD_DIM)[None, :]
    part = tl.load(
        part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=mask,
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """Split long contexts when (sequence, KV head) programs alone would leave SMs idle."""
    programs = batch * num_kv_heads
    if programs >= num_sms or max_context_len < 2 * MIN_KEYS_PER_SPLIT:
        return 1
    by_length = max_context_len // MIN_KEYS_PER_SPLIT
    by_occupancy = triton.cdiv(2 * num_sms, programs)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its pages.

    q: [B, num_heads, head_dim]; block_tables: [B, max_pages]; context_lens: [B] keys per
    sequence, the current token included (already written to its page). `max_context_len`
    (a host int, known when the step is built) sizes the splits without a device sync.
    """
    check_cache(k_cache)
    b, num_heads, d = q.shape
    _, page_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    q = rows(q)
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    num_splits = max(1, min(num_splits, triton.cdiv(max(max_context_len, 1), DECODE_BLOCK_N)))
    # Each split covers whole key tiles, so only the last one can be partial.
    keys_per_split = (
        triton.cdiv(triton.cdiv(max(max_context_len, 1), num_splits), DECODE_BLOCK_N)
        * DECODE_BLOCK_N
    )
    split = num_splits > 1
    if split:
        part = torch.empty((b, num_heads, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, num_heads, num_splits), dtype=torch.float32, device=q.device)
        target, (sob, soh, sos) = part, part.stride()[:3]
    else:
        lse = torch.empty((1, 1), dtype=torch.float32, device=q.device)  # unused
        target, (sob, soh), sos = out, out.stride()[:2], 0
    block_d = triton.next_power_of_2(d)
    _decode_kernel[(b, kvh, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        target,
        lse,
        scale * LOG2E,
        keys_per_split,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        sob,
        soh,
        sos,
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_N=DECODE_BLOCK_N,
        PAGE_SIZE=page_size,
        SPLIT=split,
        UPCAST=upcast_dot(q.dtype),
        PRECISION=dot_precision(q.dtype),
        num_warps=4,
    )
    if split:
        _split_reduce_kernel[(b, num_heads)](
            part,
            lse,
            out,
            num_splits,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=d,
            BLOCK_D=block_d,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4,
        )
    return out
