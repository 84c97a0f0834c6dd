"""int8 KV pages in torch: the reference for the CPU kernels' layout, and the paths that do not
go through them (SDPA over gathered pages, the tests).

A row of one (token, KV head) holds head_dim int8 codes and then, in its last 4 bytes, the
float32 scale that multiplies them: scale = the row's largest magnitude * (1 / 127) in float32,
codes = x * (1 / scale) rounded to nearest even (llama.cpp's q8_0 KV blocks, with one scale a head
row). An int8 cache is [pages, page_size, kv_heads, head_dim + SCALE_BYTES].
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements in one (token, KV head) row of a cache of `dtype`."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size of a KV cache (int8 rows carry their scale after the codes)."""
    return cache.shape[-1] - (SCALE_BYTES if cache.dtype == torch.int8 else 0)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> int8 rows [..., D + 4]; all-zero rows get codes 0 and scale 0."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) * (1 / 127)
    codes = torch.where(scale > 0, torch.round(xf * scale.reciprocal()), 0)
    codes = codes.clamp(-127, 127).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D + 4] -> [..., D] in `dtype`, through float32."""
    codes, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
    return (codes.float() * scale.contiguous().view(torch.float32)).to(dtype)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows as a cache of `dtype` holds them."""
    return quantize(x) if dtype == torch.int8 else x.to(dtype)


def from_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache's rows as values of `dtype`."""
    return dequantize(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)
