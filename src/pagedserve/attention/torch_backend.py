"""Paged attention for CPUs: fused C++ decode and prefill, torch SDPA for the rest.

On CPU, new K/V rows are written and queries attend straight from the pages by the C++ kernels
of pagedserve.cpu_kernels at every kernel level (no gathered copy, no padding): decodes, and
prefill chunks with head sizes that are multiples of 16 (all of a step's chunks in one call).
Elsewhere (this backend on a
GPU, as a reference) decodes gather their pages for SDPA, grouped by length: padding every one
to the longest multiplies the bytes gathered (a 900-token sequence among 200-token ones makes
the step pay ~4x), so a new group starts where padding to the group's longest would waste more
than a group costs. Grouped-query attention never copies K/V per query head: a KV head's query
heads are laid along the query-length axis, so one SDPA call covers the group.

Where the C++ prefill kernel does not serve, each prefill chunk attends on its own: without
cached context straight from its new K/V (causal, no gather); after cached pages (prefix
cache, chunked prefill) over its gathered pages with a bottom-right causal mask. The plan is
built once per step in `prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.int8_pages import from_cache, head_dim_of, to_cache
from pagedserve.cpu_kernels import ops

# Padded page reads that one more SDPA group is worth (its calls' fixed cost, measured on the
# reference 2-core CPU: ~3 calls of ~20 us per layer against ~0.1 us per gathered page).
_GROUP_COST_PAGES = 128


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None  # [n] decode rows of the group; None: all of them, in order
    block_tables: torch.Tensor  # [n, pages], pages = the group's longest
    mask: torch.Tensor | None  # [n, 1, 1, pages * page_size]; None when every key is valid


@dataclass
class _PrefillRow:
    start: int  # first of its tokens among the step's prefill tokens
    q_len: int
    pages: torch.Tensor  # [ceil(context / page_size)] its pages
    mask: torch.Tensor | None  # [q_len, pages * page_size] bottom-right causal; None: no cache


@dataclass
class _Plan:
    meta: AttentionMetadata
    decode_groups: list[_DecodeGroup]
    prefill_rows: list[_PrefillRow]


def group_by_length(pages: list[int], cost: int = _GROUP_COST_PAGES) -> list[list[int]]:
    """Indices grouped longest first; a group ends where padding the rest to its longest page
    count would waste more than `cost` page reads."""
    order = sorted(range(len(pages)), key=lambda i: -pages[i])
    groups: list[list[int]] = []
    for pos, i in enumerate(order):
        if groups:
            longest = pages[groups[-1][0]]
            if (longest - pages[i]) * (len(order) - pos) <= cost:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def _gather_pages(
    cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[B, pages] page ids -> [B, kv_heads, pages * page_size, head_dim] in `dtype` (the
    queries'; the pages may hold another, int8 included)."""
    b, n = block_tables.shape
    num_pages, page_size, kvh, width = cache.shape
    # index_select over whole pages copies rows with memcpy: 2.6x faster than cache[tables].
    rows = torch.index_select(cache.view(num_pages, -1), 0, block_tables.reshape(-1))
    return from_cache(rows.view(b, n * page_size, kvh, width), dtype).transpose(1, 2)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, fused: bool = True) -> None:
        """fused: the C++ kernels for the KV write and decodes (CPU tensors only)."""
        self.fused = fused
        self._plan: _Plan | None = None

    def prepare(self, meta: AttentionMetadata, page_size: int, num_q_per_kv: int) -> None:
        decode_groups = []
        if (nd := meta.num_decode_tokens) and not self.fused:
            lens = meta.decode_context_lens
            pages = ((lens + page_size - 1) // page_size).tolist()
            for group in group_by_length(pages):
                width = pages[group[0]]
                rows = torch.tensor(group) if len(group) < nd else None  # None: all, in order
                glens = lens if rows is None else lens[rows]
                tables = (
                    meta.decode_block_tables if rows is None else meta.decode_block_tables[rows]
                )
                mask = None
                if int(glens.min()) < width * page_size:
                    keys = torch.arange(width * page_size)
                    mask = (keys[None, :] < glens[:, None])[:, None, None]
                decode_groups.append(_DecodeGroup(rows, tables[:, :width], mask))
        prefill_rows = []
        start = 0
        q_lens = meta.prefill_q_lens.tolist()
        contexts = meta.prefill_context_lens.tolist()
        for row, (q_len, context) in enumerate(zip(q_lens, contexts, strict=True)):
            n = -(-context // page_size)
            pages, mask = meta.prefill_block_tables[row, :n], None
            if context > q_len:
                keys = torch.arange(n * page_size)
                q_pos = torch.arange(context - q_len, context)
                mask = keys[None, :] <= q_pos[:, None]
            prefill_rows.append(_PrefillRow(start, q_len, pages, mask))
            start += q_len
        self._plan = _Plan(meta, decode_groups, prefill_rows)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None or plan.meta is not meta:
            raise RuntimeError("prepare() was not called for this step's metadata")
        kvh, d = k_cache.shape[2], head_dim_of(k_cache)
        num_heads = q.shape[1]
        g = num_heads // kvh
        nd = meta.num_decode_tokens
        # Callers may pass no new K/V (the pages already hold them); then read every key there.
        with_new_kv = k.shape[0] == q.shape[0]
        decoded = None
        if self.fused:
            ops().write_kv_(k, v, k_cache, v_cache, meta.slot_mapping)
            if nd:
                tables, lens = meta.decode_block_tables, meta.decode_context_lens
                decoded = ops().paged_decode_attention(
                    q[:nd], k_cache, v_cache, tables, lens, scale
                )
                if not plan.prefill_rows:
                    return decoded
        else:
            for x, cache in ((k, k_cache), (v, v_cache)):
                rows = cache.view(-1, kvh, cache.shape[-1])
                rows.index_copy_(0, meta.slot_mapping, to_cache(x, cache.dtype))

        out = torch.empty_like(q)
        if decoded is not None:
            out[:nd] = decoded
        for group in plan.decode_groups:
            qd = q[:nd] if group.rows is None else q[:nd].index_select(0, group.rows)
            qd = qd.view(-1, kvh, g, d)
            kd = _gather_pages(k_cache, group.block_tables, q.dtype)
            vd = _gather_pages(v_cache, group.block_tables, q.dtype)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask, scale=scale)
            od = od.reshape(-1, num_heads, d)
            if group.rows is None:
                out[:nd] = od
            else:
                out.index_copy_(0, group.rows, od)
        rows = plan.prefill_rows
        if self.fused and rows and ops().prefill_attention_supported(q):
            # Every chunk at once from the pages (its own K/V written above), by the C++
            # kernel.
            starts, lens = [r.start for r in rows], [r.q_len for r in rows]
            ops().prefill_attention_(
                q[nd:], k_cache, v_cache, out[nd:], starts, lens,
                meta.prefill_context_lens, meta.prefill_block_tables, scale,
            )  # fmt: skip
            return out
        for row in rows:
            span = slice(nd + row.start, nd + row.start + row.q_len)
            qp = q[span].transpose(0, 1)[None]  # [1, H, q_len, d]
            if row.mask is None:  # no cached context: causal over its own K/V
                if with_new_kv:  # as the pages hold them: rounded to the cache's dtype
                    kp, vp = (
                        from_cache(to_cache(x[span], k_cache.dtype), q.dtype).transpose(0, 1)[None]
                        for x in (k, v)
                    )
                else:
                    kp = _gather_pages(k_cache, row.pages[None], q.dtype)[:, :, : row.q_len]
                    vp = _gather_pages(v_cache, row.pages[None], q.dtype)[:, :, : row.q_len]
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                kp = _gather_pages(k_cache, row.pages[None], q.dtype)
                vp = _gather_pages(v_cache, row.pages[None], q.dtype)
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=row.mask, scale=scale, enable_gqa=True
                )
            out[span] = op[0].transpose(0, 1)
        return out
