"""The fused C++ CPU kernels (pagedserve.cpu_kernels) against their torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_cases import NUM_KV_HEADS, Pool, make_meta
from pagedserve.attention import int8_pages
from pagedserve.attention.torch_backend import TorchAttentionBackend
from pagedserve.cpu_kernels import HEADERS, build_name, isa, ops
from pagedserve.models import layer_ops
from pagedserve.models.linear import Linear
from pagedserve.structured.bitmask import StepMask, masked_logits_torch

# Every kernel test runs at each level this CPU supports (conftest.kernel_level).
pytestmark = pytest.mark.usefixtures("kernel_level")

DTYPES = [torch.float32, torch.bfloat16]
# bf16 results may differ from the reference by one rounding step of the output.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_rms_norm_and_residual_add(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    weight = torch.rand(96, generator=gen).to(dtype)
    close(layer_ops.rms_norm(x, weight, 1e-5), layer_ops.rms_norm_torch(x, weight, 1e-5))

    want_sum = x + residual
    want = layer_ops.rms_norm_torch(want_sum, weight, 1e-5)
    got, got_sum = layer_ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    assert torch.equal(got_sum, want_sum)  # the residual add rounds exactly like torch's
    close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = (torch.randn(9, 2 * 80, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    close(layer_ops.silu_and_mul(x), layer_ops.silu_and_mul_torch(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_takes_the_first_maximum(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=gen).to(dtype)
    x[1, 3] = x[1, 999] = 9.0  # ties: the first wins, as in torch.argmax
    x[2, 999] = 9.0  # the last position, in a partial block
    x[3] = -2.0  # a constant row
    x[4, 256] = x[4, 700] = 9.0  # the first of a later block
    x[5] = -torch.finfo(dtype).max
    got = ops().argmax_rows(x)
    assert got.tolist() == x.argmax(dim=-1).tolist() == [x[0].argmax().item(), 3, 999, 0, 256, 0]
    assert ops().argmax_rows(x[:0]).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_masked_logits_equals_the_torch_mask(dtype):
    gen = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partial
    logits = torch.randn(5, vocab + 24, generator=gen).to(dtype)[:, :vocab]  # strided rows
    bits = torch.randint(-(2**31), 2**31 - 1, (3, 32), generator=gen, dtype=torch.int32)
    bits[0, :10] = 0  # whole words forbidden
    bits[1, 5:20] = -1  # whole words allowed
    bits[2] = 0  # a dead end
    mask = StepMask(torch.tensor([3, 0, 4]), bits)
    got = ops().masked_logits(logits, mask.rows, mask.bits)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, masked_logits_torch(logits, mask))
    assert torch.isneginf(got[4]).all() and torch.equal(got[[1, 2]], logits[[1, 2]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_fused_qkv_views(dtype):
    gen = torch.Generator().manual_seed(1)
    t, hq, hk, d = 6, 6, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)  # row-strided views, as in the model
    positions = torch.tensor([0, 5, 9, 10, 11, 63])
    angles = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    rope = layer_ops.RopeStep(angles.cos(), angles.sin(), positions)
    cos, sin = rope.gathered
    want_q = layer_ops.rotate_torch(q.reshape(t, hq, d), cos, sin)
    want_k = layer_ops.rotate_torch(k.reshape(t, hk, d), cos, sin)
    v_before = v.clone()
    got_q, got_k = layer_ops.apply_rotary(q.view(t, hq, d), k.view(t, hk, d), rope)
    close(got_q, want_q)
    close(got_k, want_k)
    assert got_q.data_ptr() == qkv.data_ptr()  # written in place
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_write_kv_rounds_float32_rows_into_16_bit_pages(cache_dtype):
    pool = Pool([40], 16, 64, cache_dtype)
    k = torch.randn(3, NUM_KV_HEADS, 64) * 100
    v = torch.randn(3, NUM_KV_HEADS, 64)
    slots = pool.slots(0, 20, 23)
    ops().write_kv_(k, v, pool.k, pool.v, torch.tensor(slots))
    assert torch.equal(pool.k.view(-1, NUM_KV_HEADS, 64)[slots], k.to(cache_dtype))
    assert torch.equal(pool.v.view(-1, NUM_KV_HEADS, 64)[slots], v.to(cache_dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_quantizes_rows_into_int8_pages_as_the_torch_reference(dtype):
    """Codes and scale of each (token, KV head) row equal attention/int8_pages.quantize's, an
    all-zero row included (codes 0, scale 0), and only the written slots change."""
    pool = Pool([40], 16, 64, torch.int8)
    kc, vc = pool.k.clone(), pool.v.clone()
    k = (torch.randn(3, NUM_KV_HEADS, 64) * torch.tensor([0.01, 1, 300])[:, None, None]).to(dtype)
    k[1, 0] = 0
    v = torch.randn(3, NUM_KV_HEADS, 64).to(dtype)
    slots = pool.slots(0, 20, 23)
    ops().write_kv_(k, v, kc, vc, torch.tensor(slots))
    rows = kc.view(-1, NUM_KV_HEADS, 68)
    assert torch.equal(rows[slots], int8_pages.quantize(k))
    assert torch.equal(vc.view(-1, NUM_KV_HEADS, 68)[slots], int8_pages.quantize(v))
    assert torch.equal(int8_pages.dequantize(rows[slots[1]], torch.float32)[0], torch.zeros(64))
    error = (int8_pages.dequantize(rows[slots], torch.float32) - k.float()).abs()
    assert (error <= k.float().abs().amax(-1, keepdim=True) / 254 * 1.0001).all()
    rows[slots] = pool.k.view(-1, NUM_KV_HEADS, 68)[slots]
    assert torch.equal(kc, pool.k)


def test_kv_kernels_refuse_a_cache_dtype_they_cannot_read():
    pool = Pool([5], 16, 64, torch.float32)
    k = torch.randn(1, NUM_KV_HEADS, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="a Float KV cache under BFloat16 activations"):
        ops().write_kv_(k, k, pool.k, pool.v, torch.tensor(pool.slots(0, 4, 5)))
    q = torch.randn(1, NUM_KV_HEADS, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="a Float KV cache under BFloat16 activations"):
        ops().paged_decode_attention(q, pool.k, pool.v, pool.block_tables, torch.tensor([5]), 1.0)


def test_float16_pages_widen_exactly():
    """Every float16 value (subnormals, infinities, NaNs) read from a page: a one-token context
    returns its value row times a probability of exactly 1."""
    d, seqs = 64, 2**16 // (NUM_KV_HEADS * 64)
    values = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    v_cache = values.view(seqs, 1, NUM_KV_HEADS, d)
    k_cache = torch.zeros_like(v_cache)
    q = torch.randn(seqs, NUM_KV_HEADS, d)
    tables = torch.arange(seqs).view(seqs, 1)
    out = ops().paged_decode_attention(q, k_cache, v_cache, tables, torch.ones(seqs).long(), 1.0)
    torch.testing.assert_close(
        out, v_cache.view(seqs, NUM_KV_HEADS, d).float(), rtol=0, atol=0, equal_nan=True
    )


def test_write_kv_skips_padding_slots():
    pool = Pool([5], 4, 16, torch.float32)
    kc, vc = pool.k.clone(), pool.v.clone()
    k = torch.randn(2, NUM_KV_HEADS, 16)
    v = torch.randn(2, NUM_KV_HEADS, 16)
    slot = pool.slots(0, 3, 4)[0]
    ops().write_kv_(k, v, kc, vc, torch.tensor([slot, -1]))
    assert torch.equal(kc.view(-1, NUM_KV_HEADS, 16)[slot], k[0])
    assert torch.equal(vc.view(-1, NUM_KV_HEADS, 16)[slot], v[0])
    kc.view(-1, NUM_KV_HEADS, 16)[slot] = pool.k.view(-1, NUM_KV_HEADS, 16)[slot]
    assert torch.equal(kc, pool.k)  # nothing else was written


# (query heads per KV head, head_dim, dtype, page_size, the pages' dtype)
F16, F32, BF16, I8 = torch.float16, torch.float32, torch.bfloat16, torch.int8
CASES = [
    (1, 64, F32, 16, F32),
    (3, 64, BF16, 16, BF16),
    (8, 128, F32, 4, F32),
    (3, 128, BF16, 32, BF16),
    (8, 128, BF16, 16, BF16),  # with AMX: the tile path for 16-token bf16 pages
    (2, 64, BF16, 16, BF16),
    (4, 64, BF16, 4, BF16),  # with AVX-512 BF16: its unit, over pages of any size
    (5, 64, BF16, 16, BF16),  # a head count without a bfloat16 unit: the AVX2 one
    (3, 64, F32, 16, F16),  # float32 activations over float16 pages (auto on float32 CPUs)
    (1, 128, F32, 4, F16),
    (3, 64, F32, 16, BF16),
    # int8 pages (a scale a row): under each activation dtype, odd head counts, tiny pages
    (3, 64, BF16, 16, I8),
    (8, 128, BF16, 16, I8),
    (5, 64, F32, 4, I8),
    (2, 128, F16, 32, I8),
    (3, 128, F32, 4, I8),  # AVX2: 3 heads x 32 dims a pass over the values, each row's scale
]


@pytest.mark.parametrize(("group", "head_dim", "dtype", "page_size", "cache_dtype"), CASES)
def test_backend_fused_matches_sdpa(group, head_dim, dtype, page_size, cache_dtype):
    """A mixed step (decodes of lengths 1 to 200, partly filled pages, then prefill chunks with
    and without cached context) through the fused CPU path and the SDPA path (which converts
    the pages to the queries' dtype)."""
    # Nine decodes: with two threads, enough that the kernel hands out whole sequences.
    q_lens = [1, 1, 1, 1, 1, 1, 1, 1, 1, 9, 5]
    contexts = [1, 16, 17, 150, 33, 64, 5, 200, 31, 9, 40]
    pool = Pool(contexts, page_size, head_dim, cache_dtype)
    meta = make_meta(pool, q_lens, contexts)
    t = sum(q_lens)
    q = pool.randn(t, NUM_KV_HEADS * group, head_dim, dtype=dtype)
    k = pool.randn(t, NUM_KV_HEADS, head_dim, dtype=dtype)
    v = pool.randn(t, NUM_KV_HEADS, head_dim, dtype=dtype)
    results = []
    for fused in (True, False):
        backend = TorchAttentionBackend(fused=fused)
        backend.prepare(meta, page_size, group)
        kc, vc = pool.k.clone(), pool.v.clone()
        out = backend.forward(q, k, v, kc, vc, meta, head_dim**-0.5)
        results.append((out, kc, vc))
    (out, kc, vc), (ref, ref_kc, ref_vc) = results
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    close(out, ref)

    decode_only = make_meta(pool, q_lens[:9], contexts[:9], write=False)
    backend = TorchAttentionBackend(fused=True)
    backend.prepare(decode_only, page_size, group)
    empty = torch.empty(0, NUM_KV_HEADS, head_dim, dtype=dtype)
    got = backend.forward(q[:9], empty, empty, kc, vc, decode_only, head_dim**-0.5)
    close(got, ref[:9])


@pytest.mark.parametrize(
    ("group", "head_dim", "dtype", "cache_dtype"),
    [
        (1, 64, BF16, BF16),
        (3, 64, F32, F32),
        (8, 128, BF16, BF16),
        (2, 128, F32, F32),
        (3, 80, BF16, BF16),
        (3, 64, F32, F16),
        (2, 128, F32, BF16),
        (3, 64, BF16, I8),
        (2, 128, BF16, I8),
        (1, 128, F32, I8),
        (2, 80, F16, I8),
    ],
)
def test_prefill_attention_matches_sdpa_per_chunk(group, head_dim, dtype, cache_dtype):
    """Chunks of odd lengths (partial blocks of 16 queries and 32 keys), some after cached
    context, q as a view of one fused qkv output, keys and values from scattered pages; against
    SDPA over each chunk's gathered keys with a bottom-right causal mask."""
    lens = [1, 5, 16, 17, 33, 100, 147, 7, 40]
    contexts = [1, 5, 16, 17, 33, 100, 147, 70, 300]  # the last two after cached context
    pool = Pool(contexts, 16, head_dim, cache_dtype)
    hq, t = NUM_KV_HEADS * group, sum(lens)
    qkv = pool.randn(t, (hq + 2 * NUM_KV_HEADS) * head_dim, dtype=dtype)
    q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
    assert ops().prefill_attention_supported(q)
    tables = pool.block_tables
    starts = [sum(lens[:i]) for i in range(len(lens))]
    out = torch.full((t, hq, head_dim), float("nan"), dtype=dtype)
    ops().prefill_attention_(
        q, pool.k, pool.v, out, starts, lens, torch.tensor(contexts), tables, head_dim**-0.5
    )
    for i, (s, n, c) in enumerate(zip(starts, lens, contexts, strict=True)):
        keys, values = (
            int8_pages.from_cache(cache[tables[i]].flatten(0, 1)[:c], dtype).transpose(0, 1)[None]
            for cache in (pool.k, pool.v)
        )
        mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        want = F.scaled_dot_product_attention(
            q[s : s + n].transpose(0, 1)[None],
            keys,
            values,
            attn_mask=mask,
            scale=head_dim**-0.5,
            enable_gqa=True,
        )[0].transpose(0, 1)
        close(out[s : s + n], want)


@pytest.mark.skipif(
    not isa.cpu_info().has_native_bf16(), reason="oneDNN's bf16 layout is used with native bf16"
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_in_blocked_layout(bias):
    gen = torch.Generator().manual_seed(2)
    layer = Linear(64, 48, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(48, generator=gen))
    x = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.use_blocked_layout(keep_weight=False)
    assert layer.weight.numel() == 0  # the plain copy is freed
    close(layer(x), want)


def test_build_name_follows_the_headers(tmp_path):
    """A header edit alone must give the extension a new name (so it is rebuilt)."""
    assert {h.name for h in HEADERS} >= {"amx.h", "quant_linear.h"}
    headers = [tmp_path / "a.h", tmp_path / "b.h"]
    headers[0].write_text("#pragma once\n")
    headers[1].write_text("int f();\n")
    before = build_name("generic", headers)
    assert build_name("generic", headers) == before
    assert before != build_name("avx2", headers)  # each level is its own build
    headers[1].write_text("int f(int);\n")
    assert build_name("generic", headers) != before
