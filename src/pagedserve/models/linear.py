"""The layers every model matrix uses: Linear (dense, or packed 4-bit codes for small steps)
and Embedding. Neither initialises its weight: models are built on the meta device and every
weight comes from a checkpoint (torch's initialisers on meta tensors would also import
torch._dynamo and triton, ~145 MB resident for nothing)."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.models.gguf_file import Q4_GROUP, Q4Weight

# Steps with at most this many tokens use packed 4-bit weights where a layer has them: reading
# a quarter of the bytes wins while the step is bound by memory; bigger steps are bound by
# arithmetic, where the dense kernel is faster (decode steps on the reference 2-core CPU cross
# over between 12 and 16 sequences).
INT4_MAX_TOKENS = 12


class Linear(nn.Linear):
    """nn.Linear that may also hold its weight as packed 4-bit codes, used for small steps."""

    int4: tuple[torch.Tensor, torch.Tensor] | None = None  # packed codes, scales and zeros
    blocked: torch.Tensor | None = None  # the weight in oneDNN's blocked layout (CPU)

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None and x.shape[0] <= INT4_MAX_TOKENS:
            packed, scales_zeros = self.int4
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, Q4_GROUP, scales_zeros)
            return y if self.bias is None else y + self.bias
        if self.blocked is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.blocked, self.bias, "none", [], "")
        return super().forward(x)

    def use_blocked_layout(self, keep_weight: bool) -> None:
        """Reorder the weight once into oneDNN's blocked layout, which its matmul otherwise
        redoes at every call: bf16 decode steps of 32-64 sequences 15-20% faster on the
        reference CPU (`pagedserve bench step`). Without `keep_weight` (a weight no other
        module shares) the plain copy is freed."""
        self.blocked = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 32)
        if not keep_weight:
            self.weight.data = self.weight.data.new_empty(0)

    def pack_int4(self, parts: list[Q4Weight]) -> None:
        """Pack the 4-bit codes of this layer's (fused) weight, in the kernel's layout where
        weight = (code - 8) * scale + zero per group of 32 along the input dimension."""
        codes = torch.cat([p.codes for p in parts]).to(torch.int32)
        scale = torch.cat([p.scale for p in parts])
        zero = torch.cat([p.offset for p in parts]) + 8 * scale
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(self.weight.dtype)
        self.int4 = (packed, scales_zeros.contiguous())


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass
