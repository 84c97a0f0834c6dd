"""The layers every model matrix uses: Linear and Embedding, dense or packed from GGUF's
quantized blocks (models/quant_weight.py). Neither initialises its weight: models are built
on the meta device and every weight comes from a checkpoint (torch's initialisers on meta
tensors would also import torch._dynamo and triton, ~145 MB resident for nothing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.quant_weight import KPackedWeight, PackedWeight


class Linear(nn.Linear):
    """nn.Linear whose weight may be packed codes or in oneDNN's blocked layout."""

    packed: PackedWeight | KPackedWeight | None = None
    blocked: torch.Tensor | None = None  # the weight in oneDNN's blocked layout (CPU)
    # float32 output whatever x's dtype (the output matrix: logits). Packed weights write their
    # float32 sums unrounded, so bfloat16 activations do not round near-equal logits into ties
    # (argmax then took the lower token id); dense ones upcast the model dtype's product.
    float_out: bool = False

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.linear(x, self.bias, self.float_out)
        if self.blocked is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.blocked, self.bias, "none", [], "")
        else:
            y = super().forward(x)
        return y.float() if self.float_out else y

    def use_packed(self, packed: PackedWeight | KPackedWeight) -> None:
        """Multiply by `packed` from now on; the dense weight is freed."""
        self.packed = packed
        self.weight.data = self.weight.data.new_empty(0)

    def use_blocked_layout(self, keep_weight: bool) -> None:
        """Reorder the weight once into oneDNN's blocked layout, which its matmul otherwise
        redoes at every call: bf16 decode steps of 32-64 sequences 15-20% faster on the
        reference CPU (`pagedserve bench step`). Without `keep_weight` (a weight no other
        module shares) the plain copy is freed."""
        self.blocked = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 32)
        if not keep_weight:
            self.weight.data = self.weight.data.new_empty(0)


class Embedding(nn.Embedding):
    """nn.Embedding whose table may be packed codes (shared with a tied output matrix)."""

    packed: PackedWeight | KPackedWeight | None = None

    def reset_parameters(self) -> None:
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.rows(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)

    def use_packed(self, packed: PackedWeight | KPackedWeight) -> None:
        self.packed = packed
        self.weight.data = self.weight.data.new_empty(0)
