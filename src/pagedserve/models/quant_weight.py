"""GGUF's quantized matrices kept packed on CPU, multiplied by the kernels of
cpu_kernels/quant_linear.cpp (layouts: cpu_kernels/quant_layout.h): a decode step reads 4-5
bits per weight (Q4_0/Q4_1, Q4_K), 5.75-8.5 (Q5_K, Q6_K, Q8_0) instead of bfloat16's 16, and
the model holds no dense copy."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from pagedserve.models.gguf_file import QUANT_GROUP, KQuantWeight, QuantWeight

STRIP_COLS = 32  # output columns a kernel thread takes at a time
TILE_COLS = 16  # output columns a packed tile holds
# Four-bit block types packed alike (Q4_0's offsets are -8 d): a fused weight may join them.
_FOUR_BIT_BLOCKS = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1}


def packed_kernels_available(dtype: torch.dtype) -> bool:
    """Whether the packed kernels take activations of `dtype`: float32 and bfloat16, at every
    CPU kernel level (bfloat16 computed in float32 where the level has no bf16 products)."""
    return dtype in (torch.float32, torch.bfloat16)


def packable(parts: list[QuantWeight] | list[KQuantWeight]) -> bool:
    """Whether the row blocks `parts` (a fused weight's pieces) pack into one matrix: one
    quantization type (or Q4_0 beside Q4_1, each part whole tiles), and a shape the kernels
    take."""
    first = parts[0]
    n, k = sum(p.shape[0] for p in parts), first.shape[1]
    one_type = all(type(p) is type(first) and p.qtype == first.qtype for p in parts)
    joined = all(
        isinstance(p, QuantWeight) and p.qtype in _FOUR_BIT_BLOCKS and p.shape[0] % TILE_COLS == 0
        for p in parts
    )
    return (
        (one_type or joined)
        and all(p.shape[1] == k for p in parts)
        and n % STRIP_COLS == 0
        and k % QUANT_GROUP == 0
    )


def _cat(tensors) -> torch.Tensor:
    """The tensors stacked along their first dimension (one: as it is, no copy)."""
    return torch.cat(list(tensors)) if len(tensors) > 1 else tensors[0]


def _stacked_blocks(parts: list[QuantWeight] | list[KQuantWeight]) -> torch.Tensor:
    """The file blocks of the row blocks `parts`, stacked along N (packable ones)."""
    if not packable(parts):
        raise ValueError("these weights do not pack into one matrix")
    return _cat([p.blocks for p in parts])


def pack(parts: list[QuantWeight] | list[KQuantWeight]) -> PackedWeight | KPackedWeight:
    """The row blocks `parts` packed for the kernels of their type (packable ones)."""
    return (KPackedWeight if isinstance(parts[0], KQuantWeight) else PackedWeight).pack(parts)


@dataclass
class PackedWeight:
    """A [N, K] matrix in the kernels' tile layout (described in quant_linear.cpp)."""

    codes: torch.Tensor  # uint8 [N / 16, K / 32, tile bytes]
    scales: torch.Tensor  # float16 [N / 16, K / 32, 16]
    offsets: torch.Tensor | None  # like scales; None for 8-bit codes
    bits: int
    # Codes times activations quantized to int8 per group, where the CPU kernel level has
    # integer products for them (llama.cpp's products: 2-3x faster than float ones, rounding
    # of bfloat16's order); set by the loader.
    int8_activations: bool = False

    @classmethod
    def pack(cls, parts: list[QuantWeight]) -> PackedWeight:
        """Pack the row blocks `parts` (a fused weight's pieces, stacked along N)."""
        from pagedserve.cpu_kernels import ops

        if not packable(parts):
            raise ValueError("these weights do not pack into one matrix")
        # A packing call takes one type: Q4_0 beside Q4_1 pack apart, their tiles joined.
        runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: p.qtype)]
        packed = [
            ops().pack_quant_blocks(_cat([p.blocks for p in run]), int(run[0].qtype))
            for run in runs
        ]
        codes, scales, offsets = map(_cat, zip(*packed, strict=True))
        return cls(codes, scales, offsets, parts[0].bits)

    def kernel_args(self, bias: torch.Tensor | None) -> tuple:
        """This matrix (and a bias) as the C++ kernels take it."""
        return self.codes, self.scales, self.offsets, bias, self.bits, self.int8_activations

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False
    ) -> torch.Tensor:
        """x @ W^T (+ bias), in x's dtype or with `float_out` the float32 sums."""
        from pagedserve.cpu_kernels import ops

        return ops().quant_linear(x, *self.kernel_args(bias), float_out)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the matrix as `dtype` (an embedding lookup)."""
        from pagedserve.cpu_kernels import ops

        flat = ops().quant_rows(
            ids.reshape(-1), self.codes, self.scales, self.offsets, self.bits, dtype
        )
        return flat.view(*ids.shape, flat.shape[-1])


@dataclass
class KPackedWeight:
    """A [N, K] K-quant matrix (Q4_K, Q5_K, Q6_K) in the kernels' tile layout
    (cpu_kernels/quant_layout.h)."""

    codes: torch.Tensor  # uint8 [N / 16, K / 32, 256 + 64 * (bits - 4)]
    supers: torch.Tensor  # float32 [N / 16, K / 256, 2 or 1, 16]
    subs: torch.Tensor  # uint8 [N / 16, K / 32, 2, 16]
    bits: int
    # As PackedWeight's; set by the loader.
    int8_activations: bool = False

    @classmethod
    def pack(cls, parts: list[KQuantWeight]) -> KPackedWeight:
        """Pack the row blocks `parts` (a fused weight's pieces, stacked along N)."""
        from pagedserve.cpu_kernels import ops

        blocks = _stacked_blocks(parts)
        codes, supers, subs = ops().pack_kquant_blocks(blocks, int(parts[0].qtype))
        return cls(codes, supers, subs, parts[0].bits)

    def kernel_args(self, bias: torch.Tensor | None) -> tuple:
        """This matrix (and a bias) as the C++ kernels take it: kquant_linear's arguments (told
        from a block type's by the float32 scales)."""
        return self.codes, self.supers, self.subs, bias, self.bits, self.int8_activations

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False
    ) -> torch.Tensor:
        """x @ W^T (+ bias), in x's dtype or with `float_out` the float32 sums."""
        from pagedserve.cpu_kernels import ops

        return ops().kquant_linear(x, *self.kernel_args(bias), float_out)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the matrix as `dtype` (an embedding lookup)."""
        from pagedserve.cpu_kernels import ops

        flat = ops().kquant_rows(
            ids.reshape(-1), self.codes, self.supers, self.subs, self.bits, dtype
        )
        return flat.view(*ids.shape, flat.shape[-1])
