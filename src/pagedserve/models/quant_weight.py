"""GGUF's block-quantized matrices kept packed on CPU, multiplied by the kernels of
cpu_kernels/quant_linear.cpp: a decode step reads 4-5 bits per weight (Q4_0/Q4_1) or 8.5
(Q8_0) instead of bfloat16's 16, and the model holds no dense copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.models.gguf_file import QUANT_GROUP, QuantWeight

TILE_COLS = 16  # output columns per packed tile
STRIP_COLS = 32  # output columns a kernel thread takes at a time


def packed_kernels_available(dtype: torch.dtype) -> bool:
    """Whether the packed kernels take activations of `dtype`: float32 and bfloat16, at every
    CPU kernel level (bfloat16 computed in float32 where the level has no bf16 products)."""
    return dtype in (torch.float32, torch.bfloat16)


def packable(parts: list[QuantWeight]) -> bool:
    """Whether the row blocks `parts` (a fused weight's pieces) pack into one matrix: one
    quantization type, and a shape the kernels take."""
    first = parts[0]
    n, k = sum(p.codes.shape[0] for p in parts), first.codes.shape[1]
    return (
        all(p.bits == first.bits and (p.offset is None) == (first.offset is None) for p in parts)
        and n % STRIP_COLS == 0
        and k % QUANT_GROUP == 0
    )


@dataclass
class PackedWeight:
    """A [N, K] matrix in the kernels' tile layout (described in quant_linear.cpp)."""

    codes: torch.Tensor  # uint8 [N / 16, K / 32, tile bytes]
    scales: torch.Tensor  # float16 [N / 16, K / 32, 16]
    offsets: torch.Tensor | None  # like scales; None for 8-bit codes
    bits: int

    @classmethod
    def pack(cls, parts: list[QuantWeight]) -> PackedWeight:
        """Pack the row blocks `parts` (a fused weight's pieces, stacked along N)."""
        if not packable(parts):
            raise ValueError("these weights do not pack into one matrix")
        bits = parts[0].bits
        codes = torch.cat([p.codes for p in parts])
        n, k = codes.shape
        tiles, groups = n // TILE_COLS, k // QUANT_GROUP
        # [tile, column, group, row, pair] -> [tile, group, row, column * 2 + pair]
        lanes = (
            codes.view(tiles, TILE_COLS, groups, 16, 2)
            .permute(0, 2, 3, 1, 4)
            .reshape(tiles, groups, 16, 32)
        )
        if bits == 4:  # 16-bit word j of row quad q: lane j of rows 4q..4q+3, a nibble each
            quads = lanes.to(torch.uint8).view(tiles, groups, 4, 4, 32)
            low = quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)  # little-endian: low byte first
            high = quads[:, :, :, 2] | (quads[:, :, :, 3] << 4)
            packed = torch.stack([low, high], dim=-1).reshape(tiles, groups, 256)
        else:
            packed = lanes.to(torch.int8).view(torch.uint8).reshape(tiles, groups, 512)

        def per_tile(values: list[torch.Tensor]) -> torch.Tensor:
            v = torch.cat(values).view(tiles, TILE_COLS, groups)
            return v.transpose(1, 2).to(torch.float16).contiguous()

        offsets = None if parts[0].offset is None else per_tile([p.offset for p in parts])
        return cls(packed.contiguous(), per_tile([p.scale for p in parts]), offsets, bits)

    def kernel_args(self, bias: torch.Tensor | None) -> tuple:
        """This matrix (and a bias) as the C++ kernels take it."""
        return self.codes, self.scales, self.offsets, bias, self.bits

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from pagedserve.cpu_kernels import ops

        return ops().quant_linear(x, *self.kernel_args(bias))

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the matrix as `dtype` (an embedding lookup)."""
        from pagedserve.cpu_kernels import ops

        flat = ops().quant_rows(
            ids.reshape(-1), self.codes, self.scales, self.offsets, self.bits, dtype
        )
        return flat.view(*ids.shape, flat.shape[-1])
