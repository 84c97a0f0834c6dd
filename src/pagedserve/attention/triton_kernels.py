"""Triton kernels for paged attention: the KV write, decode (plain and split-K), varlen prefill.

All attention kernels read K/V straight from the pages through the block table, one key tile
at a time, with an online softmax (FlashAttention): the attention matrix is never materialised
and each K/V row is read once per KV head. A key's page is looked up per key
(`block_table[pos // PAGE_SIZE]`), so the key tile size does not have to match the page size.

Caches are [num_pages, page_size, num_kv_heads, head_dim]; the first two dims must be contiguous
with each other so that a flat slot (page * page_size + offset) addresses a row.

On CPU these run under Triton's interpreter (TRITON_INTERPRET=1, set before this module is
imported) for testing; the torch backend is the reference they are checked against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Tile sizes. tl.dot needs every dim >= 16 on GPU; 64-key tiles keep each load 8-16 KiB.
DECODE_BLOCK_N = 64
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
# Below this many keys per split, the extra reduction costs more than the parallelism buys.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 32


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _upcast_dot(dtype: torch.dtype) -> bool:
    # Triton 3.7's interpreter misreads bf16 operands of tl.dot (garbage results), while bf16
    # loads, stores and casts are right: under the interpreter, bf16 tiles are upcast to fp32
    # before each dot. On a GPU they go to the tensor cores as bf16.
    return dtype == torch.bfloat16 and interpreting()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 models get exact fp32 dots (tf32 would drift from the torch reference).
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(cache: torch.Tensor) -> None:
    if (
        cache.dim() != 4
        or cache.stride(3) != 1
        or cache.stride(0) != cache.shape[1] * cache.stride(1)
    ):
        raise ValueError("KV cache must be [num_pages, page_size, kv_heads, head_dim], row-major")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, head_dim] with a unit last stride (other strides are passed to the kernels)."""
    return x if x.stride(-1) == 1 else x.contiguous()


# ---- KV write ------------------------------------------------------------------------------


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cslot,
    stride_chead,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # A negative slot marks a padding token (e.g. a batch padded up to a CUDA graph's size).
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & (slot >= 0)
    dst = slot * stride_cslot + h * stride_chead + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k/v [T, kv_heads, head_dim] into their cache slots (slot < 0: skipped)."""
    _check_cache(k_cache)
    _check_cache(v_cache)
    t, kvh, d = k.shape
    if t == 0:
        return
    k, v = _rows(k), _rows(v)
    _kv_write_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=kvh,
        HEAD_DIM=d,
        BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_D=triton.next_power_of_2(d),
    )


# ---- shared inner loop ---------------------------------------------------------------------


@triton.jit
def _attend_tiles(
    q,
    q_pos,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head,
    start,
    end,
    qk_scale,
    stride_cpage,
    stride_cslot,
    stride_chead,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online softmax of the query rows `q` over keys [start, end) of one sequence's pages.

    Scores are kept in log2 units (qk_scale includes log2(e)) so that exp2 can be used.
    """
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        kmask = pos < end
        page = tl.load(table_ptr + pos // PAGE_SIZE, mask=kmask, other=0).to(tl.int64)
        row = page * stride_cpage + (pos % PAGE_SIZE) * stride_cslot + kv_head * stride_chead
        tile_mask = kmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=tile_mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=tile_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        valid = kmask[None, :]
        if CAUSAL:
            valid = valid & (pos[None, :] <= q_pos[:, None])
        s = tl.where(valid, s, float("-inf"))
        # Every row sees key `start` in the first tile, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


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
    acc, m_i, l_i = _attend_tiles(
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
    _check_cache(k_cache)
    b, num_heads, d = q.shape
    _, page_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    q = _rows(q)
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
        UPCAST=_upcast_dot(q.dtype),
        PRECISION=_dot_precision(q.dtype),
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
    acc, m_i, l_i = _attend_tiles(
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
    _check_cache(k_cache)
    tp, num_heads, d = q.shape
    _, page_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    q = _rows(q)
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
        UPCAST=_upcast_dot(q.dtype),
        PRECISION=_dot_precision(q.dtype),
        num_warps=4,
    )
    return out
