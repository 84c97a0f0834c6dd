"""What the Triton attention kernels share: tile sizes, checks, the online-softmax inner loop
over key tiles, and the KV write (see triton_kernels.py for the whole design)."""

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


def upcast_dot(dtype: torch.dtype) -> bool:
    # Triton 3.7's interpreter misreads bf16 operands of tl.dot (garbage results), while bf16
    # loads, stores and casts are right: under the interpreter, bf16 tiles are upcast to fp32
    # before each dot. On a GPU they go to the tensor cores as bf16.
    return dtype == torch.bfloat16 and interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 models get exact fp32 dots (tf32 would drift from the torch reference).
    return "ieee" if dtype == torch.float32 else "tf32"


def check_cache(cache: torch.Tensor) -> None:
    if (
        cache.dim() != 4
        or cache.stride(3) != 1
        or cache.stride(0) != cache.shape[1] * cache.stride(1)
    ):
        raise ValueError("KV cache must be [num_pages, page_size, kv_heads, head_dim], row-major")


def rows(x: torch.Tensor) -> torch.Tensor:
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
    check_cache(k_cache)
    check_cache(v_cache)
    t, kvh, d = k.shape
    if t == 0:
        return
    k, v = rows(k), rows(v)
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
def attend_tiles(
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
