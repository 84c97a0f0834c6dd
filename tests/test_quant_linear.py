"""The packed (block-quantized) linears of cpu_kernels/quant_linear.cpp at every kernel level
this CPU runs, against float32 products with the dense matrix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from conftest import amx_tiles, assert_int8_products
from pagedserve.cpu_kernels import ops_for
from pagedserve.cpu_kernels.isa import cpu_info, levels_supported
from pagedserve.models.gguf_file import QuantWeight
from pagedserve.models.linear import Embedding, Linear
from pagedserve.models.quant_weight import PackedWeight, packable

LEVELS = levels_supported()
DTYPES = [torch.float32, torch.bfloat16]


def quant_weight(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None):
    """The GGUF blocks of codes [n, k] (uint8 below 16, or int8), float16 scales [n, k / 32]
    and offsets: Q4_1 (d, m, nibbles of inputs i and i + 16) or, without offsets, Q8_0."""
    n, k = codes.shape
    d = scale.half().view(torch.uint8).view(n, k // 32, 2)
    groups = codes.view(torch.uint8).view(n, k // 32, 32)
    if offset is None:
        return QuantWeight(torch.cat([d, groups], -1).view(n, -1), GGMLQuantizationType.Q8_0)
    m = offset.half().view(torch.uint8).view(n, k // 32, 2)
    nibbles = groups[..., :16] | groups[..., 16:] << 4
    return QuantWeight(torch.cat([d, m, nibbles], -1).view(n, -1), GGMLQuantizationType.Q4_1)


def random_quant(n: int, k: int, bits: int, gen: torch.Generator) -> QuantWeight:
    """A random block-quantized [n, k] matrix: Q4_1 codes with offsets, or Q8_0."""
    scale = torch.rand(n, k // 32, generator=gen) * 0.05
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        offset = torch.randn(n, k // 32, generator=gen) * 0.2
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        offset = None
    return quant_weight(codes, scale, offset)


def slack(x: torch.Tensor, dense: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How far a kernel's result may be from the exact products `want`, from its roundings:
    - float32 products and sums in any order (and sum(x * c) * d + m * sum(x) per group for
      sum(x * (c * d + m))): far below 2^-16 of sum(|x| |w|) at these sizes;
    - bf16 activations: weights rounded to bf16 (the AMX and AVX-512 BF16 paths), 2^-8
      relative, and the result rounded to bf16, 2^-8 of it."""
    xa, wa = x.float().abs(), dense.abs()
    bound = 2**-16 * (xa @ wa.t())
    if x.dtype == torch.bfloat16:
        bound += 2**-8 * (xa @ wa.t()) + 2**-8 * want.abs()
    return bound


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 16, 33, 70])  # few-row paths and tiles
def test_packed_linear_matches_the_dense_matrix(level, dtype, bits, rows):
    gen = torch.Generator().manual_seed(rows * bits)
    parts = [random_quant(64, 96, bits, gen), random_quant(32, 96, bits, gen)]  # a fused weight
    packed = PackedWeight.pack(parts)
    dense = torch.cat([p.dense for p in parts])
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    for b in (None, bias):
        want = torch.nn.functional.linear(x.float(), dense, None if b is None else b.float())
        got = ops_for(level).quant_linear(x, *packed.kernel_args(b))
        assert got.dtype == dtype and got.shape == want.shape
        assert ((got.float() - want).abs() <= slack(x, dense, want)).all()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_rows_are_exact(level, dtype, bits):
    gen = torch.Generator().manual_seed(bits)
    parts = [random_quant(64, 96, bits, gen), random_quant(32, 96, bits, gen)]
    packed = PackedWeight.pack(parts)
    dense = torch.cat([p.dense for p in parts])
    ids = torch.tensor([0, 95, 17, 64, 17])
    got = ops_for(level).quant_rows(ids, packed.codes, packed.scales, packed.offsets, bits, dtype)
    assert torch.equal(got, dense[ids].to(dtype))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_packed_blocks_hold_gguf_dequantization(level, qtype):
    """Blocks that gguf quantized, packed as they lie in the file (a fused weight of two
    parts), give back gguf's dequantized rows exactly, and their codes and scales as such."""
    qtype = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(int(qtype))
    parts = [quantize(rng.standard_normal((r, 96), dtype=np.float32), qtype) for r in (48, 16)]
    weights = [QuantWeight(torch.from_numpy(p), qtype) for p in parts]
    packed = PackedWeight.pack(weights)
    dense = torch.from_numpy(np.concatenate([dequantize(p, qtype) for p in parts]))
    for w, want in zip(weights, dense.split([48, 16]), strict=True):  # codes x scale + offset
        got = w.codes.float().view(w.shape[0], -1, 32) * w.scale[..., None]
        if w.offset is not None:
            got = got + w.offset[..., None]
        assert torch.equal(got.view(w.shape), want)
    ids = torch.arange(64)
    got = ops_for(level).quant_rows(
        ids, packed.codes, packed.scales, packed.offsets, packed.bits, torch.float32
    )
    assert torch.equal(got, dense)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 8, 16])
@pytest.mark.parametrize("int8", [False, True])
def test_extreme_codes_and_activations(level, bits, rows, int8):
    """The largest codes times large activations in every group (no overflow, no lost
    precision in any path's sums: the int8 paths' 16-bit and 32-bit ones included)."""
    n, k = 32, 256
    top = 15 if bits == 4 else -128
    codes = torch.full((n, k), top, dtype=torch.uint8 if bits == 4 else torch.int8)
    scale = torch.full((n, k // 32), 0.01)
    weight = quant_weight(codes, scale, torch.full_like(scale, 0.5) if bits == 4 else None)
    packed = PackedWeight.pack([weight])
    packed.int8_activations = int8
    x = torch.full((rows, k), 3.0)
    x[:, 1::2] = 2.0
    got = ops_for(level).quant_linear(x, *packed.kernel_args(None))
    if int8 and int8_products(level, x.dtype, bits, rows):
        want, bound = int8_reference(x, weight)
    else:
        want = x @ weight.dense.t()
        bound = slack(x, weight.dense, want)
    assert ((got - want).abs() <= bound).all()


def int8_reference(x: torch.Tensor, weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's products of block codes and activations quantized per group of 32
    (quant_linear_int8.cpp): a = round(x * 127 / max|x|) and, per group,
    d * (max|x| / 127) * sum(a * c) + m * sum(x). Returns the result and its rounding bound
    (float32 sums in any order; one code of a group rounded the other way at a tie)."""
    m, k = x.shape
    xg = x.float().view(m, k // 32, 32)
    top = xg.abs().amax(-1)
    inv = torch.where(top > 0, 127 / top, torch.zeros_like(top))
    a = (xg * inv[..., None]).round()
    s = top / 127
    c = weight.codes.float().view(-1, k // 32, 32)
    per_group = torch.einsum("mgj,ngj->mng", a, c) * weight.scale * s[:, None]
    if weight.offset is not None:
        per_group += weight.offset * xg.sum(-1)[:, None]
    tie = (c.abs().amax(-1) * weight.scale.abs() * s[:, None]).sum(-1)
    return per_group.sum(-1), 2**-16 * per_group.abs().sum(-1) + tie


def int8_products(level: str, dtype: torch.dtype, bits: int, rows: int) -> bool:
    """Whether quant_linear takes int8 products for these with int8_activations: in the
    portable kernels (generic) for both code widths up to 4 rows; from AVX2 on for four-bit
    codes, and for eight-bit ones with VNNI (AVX-VNNI at avx2, AVX-512 VNNI above) or from 2
    rows on (AVX2's sign flips), but not in bf16 steps of over 8 rows where AMX has tiles
    (faster there)."""
    if level == "generic":
        return rows <= 4
    if level == "amx" and dtype == torch.bfloat16 and rows > 8:
        return False
    vnni = "avx_vnni" if level == "avx2" else "avx512_vnni"  # the level's integer products
    return bits == 4 or vnni in cpu_info().flags or rows > 1


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
# Passes of 4 and 8 rows, chunks of 32 or 64; at k = 1536 AVX2's chunks are of 16 rows.
@pytest.mark.parametrize(
    ("rows", "k"), [*((r, 192) for r in (1, 3, 4, 5, 8, 9, 16, 33, 70)), (40, 1536)]
)
def test_int8_activations_are_llama_cpp_products(level, dtype, bits, rows, k):
    """With int8_activations, block codes take integer products where the level has them
    (int8_products), float ones elsewhere. Each group's largest activation is 64x the others,
    so the others' int8 codes are coarse and a float32 result visibly not float32 products'."""
    gen = torch.Generator().manual_seed(rows)
    weight = random_quant(96, k, bits, gen)
    packed = PackedWeight.pack([weight])
    packed.int8_activations = True
    x = torch.randn(rows, k, generator=gen)
    x[:, ::32] = 64.0
    x = x.to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    got = ops_for(level).quant_linear(x, *packed.kernel_args(bias)).float()
    int8 = int8_products(level, dtype, bits, rows)
    reference = int8_reference(x, weight) if int8 else None
    assert_int8_products(got, x, weight.dense, bias, reference, slack)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 4, 5, 8, 9, 33])
@pytest.mark.parametrize("int8", [False, True])
def test_float_out_gives_bf16_rows_float32_sums(level, bits, rows, int8):
    """float_out (the output matrix's logits): bf16 activations, float32 results that are the
    kernel's sums before rounding: AMX tiles' sums, of which the bf16 result is the rounding,
    and elsewhere exactly the products of the same activations given as float32."""
    gen = torch.Generator().manual_seed(rows * bits + int8)
    weight = random_quant(64, 192, bits, gen)
    packed = PackedWeight.pack([weight])
    packed.int8_activations = int8
    x = torch.randn(rows, 192, generator=gen).to(torch.bfloat16)
    kernels = ops_for(level)
    got = kernels.quant_linear(x, *packed.kernel_args(None), float_out=True)
    assert got.dtype == torch.float32
    assert not torch.equal(got, got.bfloat16().float())  # not rounded to bf16
    if amx_tiles(level, rows, int8):
        assert torch.equal(got.bfloat16(), kernels.quant_linear(x, *packed.kernel_args(None)))
    else:
        assert torch.equal(got, kernels.quant_linear(x.float(), *packed.kernel_args(None)))


def test_output_matrix_returns_float32():
    """Linear.float_out: packed weights' float32 sums, dense ones' product upcast."""
    gen = torch.Generator().manual_seed(9)
    weight = random_quant(64, 64, 8, gen)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    packed, dense = Linear(64, 64, bias=False), Linear(64, 64, bias=False)
    packed.use_packed(PackedWeight.pack([weight]))
    dense.weight.data = weight.dense.bfloat16()
    packed.float_out = dense.float_out = True
    assert packed(x).dtype == dense(x).dtype == torch.float32
    assert torch.equal(dense(x), torch.nn.functional.linear(x, dense.weight).float())


def test_packed_linear_and_embedding_free_the_dense_copy():
    gen = torch.Generator().manual_seed(5)
    weight = random_quant(64, 64, 8, gen)
    packed = PackedWeight.pack([weight])
    layer, table = Linear(64, 64, bias=False), Embedding(64, 64)
    layer.use_packed(packed)
    table.use_packed(packed)
    assert layer.weight.numel() == table.weight.numel() == 0
    x = torch.randn(2, 64, generator=gen)
    torch.testing.assert_close(layer(x), x @ weight.dense.t(), atol=0.05, rtol=0.02)
    assert torch.equal(table(torch.tensor([3])), weight.dense[3:4])  # in the table's dtype


@pytest.mark.parametrize("level", LEVELS)
def test_q4_0_beside_q4_1_packs_as_one_matrix(level):
    """A fused weight whose parts mix Q4_0 and Q4_1 (each whole tiles of 16 rows) packs as one
    matrix: gguf's dequantized rows exactly, and its products those of the dense rows."""
    rng = np.random.default_rng(7)
    types = [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]

    def weights(rows: tuple[int, ...]) -> list[QuantWeight]:
        return [
            QuantWeight(torch.from_numpy(quantize(rng.standard_normal((r, 96), np.float32), t)), t)
            for r, t in zip(rows, types, strict=False)
        ]

    parts = weights((48, 16, 32))
    assert packable(parts)
    assert not packable(weights((24, 40)))  # whole strips together, but parts not whole tiles
    packed = PackedWeight.pack(parts)
    dense = torch.cat([p.dense for p in parts])
    ids = torch.arange(96)
    rows = ops_for(level).quant_rows(
        ids, packed.codes, packed.scales, packed.offsets, packed.bits, torch.float32
    )
    assert torch.equal(rows, dense)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(7))
    got = ops_for(level).quant_linear(x, *packed.kernel_args(None))
    want = x @ dense.t()
    assert ((got - want).abs() <= slack(x, dense, want)).all()


def test_packing_refuses_mixed_types_and_odd_shapes():
    gen = torch.Generator().manual_seed(6)
    assert packable([random_quant(32, 64, 4, gen)])
    assert not packable([random_quant(32, 64, 4, gen), random_quant(32, 64, 8, gen)])
    assert not packable([random_quant(48, 64, 4, gen)])  # 48 columns: not whole strips of 32
    with pytest.raises(ValueError, match="do not pack"):
        PackedWeight.pack([random_quant(16, 64, 8, gen)])
