"""Turns a scheduled batch into flat tensors and runs the model over the KV pages: the
single-process `Executor` (executor.py), and each tensor-parallel rank's model."""

from __future__ import annotations

import logging
from dataclasses import dataclass

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


@dataclass
class StepInput:
    """A step's flat inputs as plain host tensors: all a runner needs, and what a
    tensor-parallel rank receives from the engine (once per step)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    q_lens: torch.Tensor  # [B] new tokens of each row, single-token rows (decodes) first
    context_lens: torch.Tensor  # [B] computed + new tokens
    block_tables: torch.Tensor  # [B, max_pages]
    sample_tokens: torch.Tensor  # [S] index among the T of each sampled row's last token


def prepare_step(batch: list[ScheduledSeq], sample_rows: list[int]) -> StepInput:
    """The step's inputs in the layout attention needs: single-token rows (decodes) first, then
    multi-token chunks, each group in `batch`'s order; `sample_tokens` follow `sample_rows`."""
    order = sorted(range(len(batch)), key=lambda i: batch[i].num_new_tokens != 1)
    where = [0] * len(batch)  # batch row -> its row in the layout
    for new, old in enumerate(order):
        where[old] = new
    batch = [batch[i] for i in order]
    sample_rows = [where[i] for i in sample_rows]
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
    last_token = first_token + lens_t - 1
    return StepInput(
        _long(ids), positions, lens_t, starts_t + lens_t, tables, last_token[sample_rows]
    )


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
        self.num_pages = num_pages
        self.kv_bytes_per_page = kv_bytes_per_page(cfg, page_size, dtype)
        self.error: str | None = None  # one process cannot lose a peer
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (_zeros(shape, dtype, device), _zeros(shape, dtype, device))
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
        """Logits (the model's dtype) of the step's `sample_tokens` (empty on tensor-parallel
        ranks but 0)."""
        meta = self.build_metadata(step)
        dev = self.device
        hidden = self.model(step.input_ids.to(dev), step.positions.to(dev), self.kv_caches, meta)
        return self.model.compute_logits(hidden[step.sample_tokens.to(dev)]).cpu()

    def execute(self, batch: list[ScheduledSeq], sample_rows: list[int]) -> torch.Tensor:
        """Run one step; returns logits (the model's dtype) of the last new token of each
        `sample_rows` row."""
        return self.run(prepare_step(batch, sample_rows))

    def shutdown(self) -> None:
        pass
