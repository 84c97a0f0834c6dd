"""Turns a scheduled batch into flat tensors and runs the model over the KV pages: the
single-process `Executor` (executor.py), and each tensor-parallel rank's model."""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagedserve.attention import AttentionBackend, AttentionMetadata
from pagedserve.attention.int8_pages import row_width
from pagedserve.batch_state import BatchTables, RowPlanner, StepInput
from pagedserve.models.config import ModelConfig
from pagedserve.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    row = row_width(cfg.head_dim, dtype)
    return cfg.num_layers * 2 * page_size * cfg.num_kv_heads * row * elem


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. Zeros, not empty: attention multiplies masked-out slots by 0, and
    0 * NaN is NaN. On CPU it comes from calloc (through numpy), whose pages the kernel maps on
    first write, so resident memory grows with the pages in use rather than the pool size."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    item = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32}[item])
    return torch.from_numpy(raw).view(dtype)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        backend: AttentionBackend,
        num_pages: int,
        page_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
    ):
        self.model, self.cfg, self.backend = model, cfg, backend
        self.page_size, self.device = page_size, device
        self.num_pages = num_pages
        self.kv_bytes_per_page = kv_bytes_per_page(cfg, page_size, kv_dtype)
        self.error: str | None = None  # one process cannot lose a peer
        # The batch rows, kept between steps (every tensor-parallel rank has its tables; only
        # rank 0 plans).
        self.planner, self.tables = RowPlanner(), BatchTables()
        shape = (num_pages, page_size, cfg.num_kv_heads, row_width(cfg.head_dim, kv_dtype))
        self.kv_caches = [
            (_zeros(shape, kv_dtype, device), _zeros(shape, kv_dtype, device))
            for _ in range(cfg.num_layers)
        ]

    def build_metadata(self, step: StepInput) -> AttentionMetadata:
        lens, context, tables = step.q_lens, step.context_lens, step.block_tables
        row = torch.repeat_interleave(torch.arange(len(lens)), lens)
        page = tables[row, step.positions // self.page_size]
        slot_mapping = page * self.page_size + step.positions % self.page_size
        nd = int((lens == 1).sum())
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=nd,
            decode_block_tables=tables[:nd],
            decode_context_lens=context[:nd],
            prefill_q_lens=lens[nd:],
            prefill_context_lens=context[nd:],
            prefill_block_tables=tables[nd:],
            prefill_max_q_len=int(lens[nd:].max()) if len(lens) > nd else 0,
        )
        g = self.cfg.num_heads // self.cfg.num_kv_heads
        self.backend.prepare(meta, self.page_size, g)
        return meta

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:
        """Logits (float32) of the step's `sample_tokens` (empty on tensor-parallel
        ranks but 0)."""
        meta = self.build_metadata(step)
        dev = self.device
        hidden = self.model(step.input_ids.to(dev), step.positions.to(dev), self.kv_caches, meta)
        return self.model.compute_logits(hidden[step.sample_tokens.to(dev)]).cpu()

    def execute(self, out: SchedulerOutput, sample_rows: list[int]) -> torch.Tensor:
        """Run one step; returns logits (float32) of the last new token of each
        `sample_rows` row of `out.scheduled`."""
        return self.run(self.tables.apply(self.planner.plan(out, sample_rows)))

    def shutdown(self) -> None:
        pass
