"""The attention backend for a name and a device (kept apart from the interface in backend.py,
which the backends themselves import)."""

from __future__ import annotations

import torch

from pagedserve.attention.backend import AttentionBackend


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from pagedserve.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(fused=device.type == "cpu")
    if name == "triton":
        try:
            from pagedserve.attention.triton_backend import TritonAttentionBackend
        except ImportError as e:
            raise ValueError(
                "attention_backend 'triton' needs the triton package (pip install triton)"
            ) from e
        return TritonAttentionBackend(device)
    raise ValueError(f"attention_backend {name!r} is not available (choose from: torch, triton)")
