"""Paged attention with Triton kernels: the GPU backend (and, under the interpreter, a CPU one).

Per step, `prepare` reads the host-side metadata once (longest decode context, chunk offsets);
the first layer's `forward` moves the index tensors to the device, and every later layer of the
step reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.attention import triton_kernels as tk
from pagedserve.attention.backend import AttentionMetadata


@dataclass
class _Step:
    meta: AttentionMetadata
    max_decode_context: int
    prefill_q_starts: torch.Tensor  # [Bp] first token of each chunk among the prefill tokens
    on_device: dict[str, torch.Tensor] = field(default_factory=dict)
    device: torch.device | None = None


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, device: torch.device, num_splits: int | None = None):
        """`num_splits` fixes the decode split-K factor (default: chosen per step)."""
        if device.type != "cuda" and not tk.interpreting():
            raise ValueError(
                "attention_backend 'triton' runs on CPU only under Triton's interpreter: "
                "set TRITON_INTERPRET=1 (slow, meant for testing) or use attention_backend='torch'"
            )
        self.device = device
        self.num_splits = num_splits
        self._num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1  # the interpreter runs programs one by one: splitting only adds work
        )
        self._step: _Step | None = None

    def prepare(self, meta: AttentionMetadata, page_size: int, num_q_per_kv: int) -> None:
        max_decode = int(meta.decode_context_lens.max()) if meta.num_decode_tokens else 0
        q_lens = meta.prefill_q_lens
        self._step = _Step(meta, max_decode, torch.cumsum(q_lens, 0) - q_lens)

    def _tensors(self, meta: AttentionMetadata, device: torch.device) -> _Step:
        step = self._step
        if step is None or step.meta is not meta:
            self.prepare(meta, 0, 0)
            step = self._step
            assert step is not None
        if step.device != device:
            host = {
                "slot_mapping": meta.slot_mapping,
                "decode_block_tables": meta.decode_block_tables,
                "decode_context_lens": meta.decode_context_lens,
                "prefill_block_tables": meta.prefill_block_tables,
                "prefill_q_starts": step.prefill_q_starts,
                "prefill_q_lens": meta.prefill_q_lens,
                "prefill_context_lens": meta.prefill_context_lens,
            }
            step.on_device = {k: v.to(device).contiguous() for k, v in host.items()}
            step.device = device
        return step

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
        step = self._tensors(meta, q.device)
        t = step.on_device
        # K/V first: the prefill kernel reads a chunk's own keys back from the pages.
        tk.write_kv(k, v, k_cache, v_cache, t["slot_mapping"])
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            splits = self.num_splits or tk.choose_num_splits(
                nd, k_cache.shape[2], step.max_decode_context, self._num_sms
            )
            tk.paged_decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                t["decode_block_tables"],
                t["decode_context_lens"],
                scale,
                step.max_decode_context,
                num_splits=splits,
                out=out[:nd],
            )
        if meta.num_prefills:
            tk.paged_prefill_attention(
                q[nd:],
                k_cache,
                v_cache,
                t["prefill_block_tables"],
                t["prefill_q_starts"],
                t["prefill_q_lens"],
                t["prefill_context_lens"],
                scale,
                meta.prefill_max_q_len,
                out=out[nd:],
            )
        return out
