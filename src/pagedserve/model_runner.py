"""Turns a scheduled batch into flat tensors, runs the model over the KV pages, samples."""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagedserve.attention import AttentionBackend, AttentionMetadata
from pagedserve.models.config import ModelConfig
from pagedserve.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * page_size * cfg.num_kv_heads * cfg.head_dim * elem


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def _block_table_tensor(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    return _long([t + [0] * (width - len(t)) for t in tables]).view(len(tables), width)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. Zeros, not empty: attention multiplies masked-out slots by 0, and
    0 * NaN is NaN. On CPU it comes from calloc (through numpy), whose pages the kernel maps on
    first write, so resident memory grows with the pages in use rather than the pool size."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    item = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={2: np.uint16, 4: np.uint32}[item])
    return torch.from_numpy(raw).view(dtype)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        backend: AttentionBackend,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.model, self.cfg, self.backend = model, cfg, backend
        self.page_size, self.device = page_size, device
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (_zeros(shape, dtype, device), _zeros(shape, dtype, device))
            for _ in range(cfg.num_layers)
        ]

    def build_inputs(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`batch` must list single-token rows (decodes) first, then multi-token chunks."""
        lens = [s.num_new_tokens for s in batch]
        starts = [s.seq.num_computed_tokens for s in batch]
        ids: list[int] = []
        for s, start, n in zip(batch, starts, lens, strict=True):
            ids += s.seq.token_ids_slice(start, start + n)
        lens_t, starts_t = _long(lens), _long(starts)
        row = torch.repeat_interleave(torch.arange(len(batch)), lens_t)
        first_token = torch.cumsum(lens_t, 0) - lens_t
        positions = starts_t[row] + torch.arange(len(ids)) - first_token[row]
        tables = _block_table_tensor([s.seq.block_table for s in batch])
        page = tables[row, positions // self.page_size]
        slot_mapping = page * self.page_size + positions % self.page_size

        nd = sum(1 for n in lens if n == 1)
        context = starts_t + lens_t
        max_q = max(lens[nd:], default=0)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=nd,
            decode_block_tables=tables[:nd],
            decode_context_lens=context[:nd],
            prefill_q_lens=lens_t[nd:],
            prefill_context_lens=context[nd:],
            prefill_block_tables=tables[nd:],
            prefill_max_q_len=max_q,
        )
        g = self.cfg.num_heads // self.cfg.num_kv_heads
        self.backend.prepare(meta, self.page_size, g)
        return _long(ids), positions, meta

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], sample_rows: list[int]) -> torch.Tensor:
        """Run one step; returns float32 logits of the last new token of each `sample_rows` row."""
        input_ids, positions, meta = self.build_inputs(batch)
        dev = self.device
        hidden = self.model(input_ids.to(dev), positions.to(dev), self.kv_caches, meta)
        last = torch.cumsum(_long([s.num_new_tokens for s in batch]), 0) - 1
        return self.model.compute_logits(hidden[last[sample_rows].to(dev)]).cpu()
