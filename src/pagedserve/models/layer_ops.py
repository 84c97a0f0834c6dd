"""The model's elementwise steps: fused C++ kernels on CPU, torch ops elsewhere.

Each eager version is the reference its kernel is tested against (tests/test_cpu_kernels.py):
math in float32, rounded once to the activations' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from pagedserve.cpu_kernels import ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cpu:
        return ops().rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). On CPU both inputs are overwritten."""
    if x.is_cpu:
        ops().add_rms_norm_(x, residual, weight, eps)
        return x, residual
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate | up] along the last dimension."""
    if x.is_cpu:
        return ops().silu_and_mul(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass
class RopeStep:
    """Rotary tables and a step's positions, shared by every layer of the step."""

    cos: torch.Tensor  # [max_positions, head_dim / 2] float32
    sin: torch.Tensor
    positions: torch.Tensor  # [T]

    @cached_property
    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[self.positions][:, None, :], self.sin[self.positions][:, None, :]


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, rope: RopeStep
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding in the Hugging Face layout (halves rotated, not interleaved pairs) of
    q [T, Hq, D] and k [T, Hk, D]; on CPU in place."""
    if q.is_cpu:
        ops().rotary_(q, k, rope.positions, rope.cos, rope.sin)
        return q, k
    cos, sin = rope.gathered
    return rotate_torch(q, cos, sin), rotate_torch(k, cos, sin)
