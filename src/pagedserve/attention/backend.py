"""The interface every attention backend implements, and the per-step metadata it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to, built once per step.

    The step's tokens are laid out decodes first (one query token per sequence), then the
    prefill chunks (several query tokens per sequence, possibly after cached context).
    """

    slot_mapping: torch.Tensor  # [T] flat slot (page * page_size + offset) of each new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [Bd, max_pages]
    decode_context_lens: torch.Tensor  # [Bd] tokens to attend to, the new one included
    prefill_q_lens: torch.Tensor  # [Bp]
    prefill_context_lens: torch.Tensor  # [Bp] cached + new tokens
    prefill_block_tables: torch.Tensor  # [Bp, max_pages]
    prefill_max_q_len: int

    @property
    def num_decodes(self) -> int:
        return self.num_decode_tokens

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_q_lens.numel())


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata, page_size: int, num_q_per_kv: int) -> None:
        """Precompute what every layer of this step shares."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v to their slots, then attend each query over its sequence's pages."""
