"""Packed K-quant (Q4_K, Q5_K, Q6_K) linears at every kernel level this CPU runs, against gguf's
own dequantization, and a tiny random llama GGUF of such weights served packed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize

from conftest import TOP, agreeing_prefix, amx_tiles, assert_int8_products
from pagedserve.cpu_kernels import ops_for
from pagedserve.cpu_kernels.isa import levels_supported
from pagedserve.models.gguf_file import KQuantWeight
from pagedserve.models.quant_weight import KPackedWeight, pack, packable

LEVELS = levels_supported()
DTYPES = [torch.float32, torch.bfloat16]
Q = GGMLQuantizationType
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, rng) -> np.ndarray:
    """Rows of random K-quant super-blocks: random bytes for the codes and scales, float16 d
    (and dmin) set to finite values of the size real files have."""
    size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)

    def put(at: int, values: np.ndarray) -> None:
        raw[..., at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(n, -1, 2)

    if qtype == Q.Q6_K:
        put(208, rng.uniform(-2e-3, 2e-3, (n, k // 256)))
    else:
        put(0, rng.uniform(0, 2e-3, (n, k // 256)))
        put(2, rng.uniform(0, 2e-2, (n, k // 256)))
    return raw.reshape(n, -1)


def weights(qtype, shapes, seed: int):
    """KQuantWeights of random blocks, and each one's dense matrix by gguf.quants."""
    rng = np.random.default_rng(seed)
    parts, dense = [], []
    for n, k in shapes:
        raw = random_blocks(qtype, n, k, rng)
        parts.append(KQuantWeight(torch.from_numpy(raw), qtype))
        dense.append(torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(np.float32)))
    return parts, torch.cat(dense)


def slack(x: torch.Tensor, dense: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How far a kernel's result may be from the exact products `want`, from its roundings:
    - float32 products and sums in any order, with the offsets summed apart
      (d * sum(x * c) + m * sum(x)): each term within a few 2^-24 of sum(|x| (|c d| + |m|)),
      which for these weights is within 16x of sum(|x| |w|): far below 2^-16 of it;
    - bf16 activations: weights rounded to bf16 (the AMX path), 2^-8 relative, and the result
      rounded to bf16, 2^-8 of it."""
    xa, wa = x.float().abs(), dense.abs()
    bound = 2**-16 * (xa @ wa.t())
    if x.dtype == torch.bfloat16:
        bound += 2**-8 * (xa @ wa.t()) + 2**-8 * want.abs()
    return bound


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_codes_reproduce_gguf_dequantize(qtype):
    """The unpacked codes and scales give gguf's own dequantized values (up to one rounding
    of the d * scale * code - dmin * min order)."""
    (w,), dense = weights(qtype, [(32, 512)], seed=qtype)
    groups = w.codes.float().view(32, 16, 2, 16)  # [row, group, half, 16 inputs]
    supers = w.supers.repeat_interleave(8, dim=1)  # per group
    if qtype == Q.Q6_K:
        scale = supers[..., 0:1] * w.subs.view(torch.int8).float()  # [row, group, half]
        got = (groups - 32) * scale.unsqueeze(-1)
    else:
        scale = supers[..., 0] * w.subs[..., 0].float()
        low = supers[..., 1] * w.subs[..., 1].float()
        got = groups * scale[..., None, None] - low[..., None, None]
    torch.testing.assert_close(got.reshape(32, 512), dense, rtol=2**-22, atol=1e-7)
    assert torch.equal(w.dense, dense)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 33])  # dot products, one AMX pass, tiles
def test_kquant_linear_matches_gguf_dequantize(level, dtype, qtype, rows):
    parts, dense = weights(qtype, [(64, 512), (32, 512)], seed=rows * 31 + qtype)
    packed = pack(parts)  # a fused weight of two row blocks
    assert isinstance(packed, KPackedWeight)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    for b in (None, bias):
        want = torch.nn.functional.linear(x.float(), dense, None if b is None else b.float())
        got = ops_for(level).kquant_linear(x, *packed.kernel_args(b))
        assert got.dtype == dtype and got.shape == want.shape
        assert ((got.float() - want).abs() <= slack(x, dense, want)).all()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 9, 33])
@pytest.mark.parametrize("int8", [False, True])
def test_float_out_gives_bf16_rows_float32_sums(level, qtype, rows, int8):
    """As test_quant_linear's: with float_out, bf16 rows' float32 sums before rounding."""
    parts, _ = weights(qtype, [(32, 512)], seed=rows + qtype)
    packed = pack(parts)
    packed.int8_activations = int8
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    kernels = ops_for(level)
    got = kernels.kquant_linear(x, *packed.kernel_args(None), float_out=True)
    assert got.dtype == torch.float32
    assert not torch.equal(got, got.bfloat16().float())
    if amx_tiles(level, rows, int8):
        assert torch.equal(got.bfloat16(), kernels.kquant_linear(x, *packed.kernel_args(None)))
    else:
        assert torch.equal(got, kernels.kquant_linear(x.float(), *packed.kernel_args(None)))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_kquant_rows_match_gguf_dequantize(level, dtype, qtype):
    parts, dense = weights(qtype, [(64, 256), (32, 256)], seed=qtype)
    packed = pack(parts)
    ids = torch.tensor([0, 95, 17, 64, 17])
    got = ops_for(level).kquant_rows(
        ids, packed.codes, packed.supers, packed.subs, packed.bits, dtype
    )
    torch.testing.assert_close(got, dense[ids].to(dtype), rtol=2**-22, atol=1e-7)


def int8_k_products(level: str, dtype: torch.dtype, rows: int) -> bool:
    """Whether kquant_linear takes int8 products for `rows` rows with int8_activations: as for
    block types' four-bit codes, every row count from AVX2 on, up to 4 rows portably, but not
    in bf16 steps of over 8 rows where AMX has tiles."""
    if level == "generic":
        return rows <= 4
    return not (level == "amx" and dtype == torch.bfloat16 and rows > 8)


def int8_k_reference(x: torch.Tensor, w: KQuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's products of K codes and activations quantized per group of 32
    (quant_linear_int8.cpp): a = round(x * 127 / max|x|), s = max|x| / 127 and, per half of 16
    inputs (Q6_K's halves have their own scales), d * s * sum(a * c) + m * sum(x) with the
    group's d and m of the unpacked codes (weight = c * d + m). Returns the result and its
    rounding bound, as test_quant_linear's int8_reference."""
    (m, k), n = x.shape, w.shape[0]
    xg = x.float().view(m, k // 32, 2, 16)
    top = xg.abs().amax((-1, -2))
    inv = torch.where(top > 0, 127 / top, torch.zeros_like(top))
    a = (xg * inv[..., None, None]).round()
    s = (top / 127)[:, None, :, None]  # [m, 1, groups, 1]
    c = w.codes.float().view(n, k // 32, 2, 16)
    supers = w.supers.repeat_interleave(8, dim=1)  # per group
    if w.qtype == Q.Q6_K:
        d = supers[..., 0:1] * w.subs.view(torch.int8).float()  # [n, groups, half]
        off = -32 * d
    else:
        d = (supers[..., 0] * w.subs[..., 0].float())[..., None].expand(-1, -1, 2)
        off = -(supers[..., 1] * w.subs[..., 1].float())[..., None].expand(-1, -1, 2)
    per_half = torch.einsum("mghj,nghj->mngh", a, c) * d * s + off * xg.sum(-1)[:, None]
    tie = (c.amax(-1) * d.abs() * s).sum((-1, -2))
    return per_half.sum((-1, -2)), 2**-16 * per_half.abs().sum((-1, -2)) + tie


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 33, 70])  # AVX2's chunks: 32 rows at k = 512
def test_kquant_int8_activations_are_llama_cpp_products(level, dtype, qtype, rows):
    """With int8_activations, K codes take integer products where the level has them
    (int8_k_products), its float or bfloat16 ones elsewhere. Each group's largest activation
    is 64x the others, so a float32 result visibly is not float32 products'."""
    (w,), dense = weights(qtype, [(96, 512)], seed=rows * 7 + qtype)
    packed = pack([w])
    packed.int8_activations = True
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=gen)
    x[:, ::32] = 64.0
    x = x.to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    got = ops_for(level).kquant_linear(x, *packed.kernel_args(bias)).float()
    reference = int8_k_reference(x, w) if int8_k_products(level, dtype, rows) else None
    assert_int8_products(got, x, dense, bias, reference, slack)


# The bytes of a K super-block that hold its codes (the rest: d, dmin and scales).
CODE_BYTES = {Q.Q4_K: slice(16, 144), Q.Q5_K: slice(16, 176), Q.Q6_K: slice(0, 192)}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_kquant_int8_extreme_codes(level, qtype, rows):
    """Every code the largest of its width, times activations all at the largest int8 code:
    the 16-bit sums of the integer products reach their bound without overflowing."""
    rng = np.random.default_rng(qtype)
    blocks = random_blocks(qtype, 32, 512, rng).reshape(32, 2, -1)
    blocks[..., CODE_BYTES[qtype]] = 0xFF
    w = KQuantWeight(torch.from_numpy(blocks.reshape(32, -1)), qtype)
    assert int(w.codes.min()) == 2**w.bits - 1
    packed = pack([w])
    packed.int8_activations = True
    x = torch.full((rows, 512), 3.0)
    got = ops_for(level).kquant_linear(x, *packed.kernel_args(None))
    if int8_k_products(level, x.dtype, rows):
        want, bound = int8_k_reference(x, w)
    else:
        want = x @ w.dense.t()
        bound = slack(x, w.dense, want)
    assert ((got - want).abs() <= bound).all()


def test_mixed_k_types_stay_apart():
    (q4,), _ = weights(Q.Q4_K, [(32, 256)], seed=1)
    (q6,), _ = weights(Q.Q6_K, [(32, 256)], seed=2)
    assert packable([q4]) and packable([q6])
    assert not packable([q4, q6])


# ---- end to end: a tiny llama GGUF of Q4_K / Q6_K matrices ---------------------------------
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS, CONTEXT = 256, 512, 4, 2, 512, 2, 256


def write_tiny_llama(path, tokenizer_of: str | None = None) -> None:
    """The tiny llama at `path`; with `tokenizer_of` (a GGUF of VOCAB tokens), that file's
    tokenizer, so that llama.cpp serves it too (scripts/write_kquant_gguf.py)."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    if tokenizer_of is not None:
        for key, field in GGUFReader(tokenizer_of).fields.items():
            if key.startswith("tokenizer."):
                sub_type = field.types[-1] if len(field.types) > 1 else None
                w.add_key_value(key, field.contents(), field.types[0], sub_type)
    w.add_block_count(LAYERS)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_context_length(CONTEXT)
    w.add_vocab_size(VOCAB)
    w.add_layer_norm_rms_eps(1e-5)

    def quant(name: str, qtype, n: int, k: int) -> None:
        w.add_tensor(name, random_blocks(qtype, n, k, rng), raw_dtype=qtype)

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    quant("token_embd.weight", Q.Q4_K, VOCAB, HIDDEN)  # looked up packed (kquant_rows)
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):  # Q4_K_M's mix: Q4_K, with Q6_K for some matrices
        norm(f"blk.{i}.attn_norm.weight")
        quant(f"blk.{i}.attn_q.weight", Q.Q4_K, HIDDEN, HIDDEN)
        quant(f"blk.{i}.attn_k.weight", Q.Q4_K, kv, HIDDEN)
        quant(f"blk.{i}.attn_v.weight", Q.Q4_K, kv, HIDDEN)
        quant(f"blk.{i}.attn_output.weight", Q.Q6_K, HIDDEN, HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight")
        quant(f"blk.{i}.ffn_gate.weight", Q.Q4_K, FFN, HIDDEN)
        quant(f"blk.{i}.ffn_up.weight", Q.Q4_K, FFN, HIDDEN)
        quant(f"blk.{i}.ffn_down.weight", Q.Q6_K, HIDDEN, FFN)
    norm("output_norm.weight")
    quant("output.weight", Q.Q6_K, VOCAB, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_kquant_llama_is_packed_and_greedy_equal_to_dense(tmp_path, monkeypatch):
    from pagedserve import LLM, SamplingParams, engine
    from pagedserve.models.loader import ModelSource, load_tokenizer

    # The file holds no vocabulary: token ids in, the default model's tokenizer for the text.
    tokenizer = load_tokenizer(ModelSource.resolve(None))
    monkeypatch.setattr(engine, "load_tokenizer", lambda source: tokenizer)
    path = tmp_path / "tiny-kquant.gguf"
    write_tiny_llama(path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[(7 * i + j * 13) % VOCAB for j in range(3 + 5 * i)] for i in range(6)]
    common = dict(dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=32)

    packed = LLM(str(path), **common)
    model = packed.engine.model
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
            assert isinstance(linear.packed, KPackedWeight) and linear.weight.numel() == 0
    assert model.layers[0].mlp.down_proj.packed.bits == 6
    assert isinstance(model.lm_head.packed, KPackedWeight) and model.lm_head.weight.numel() == 0
    assert model.embed_tokens.weight.numel() == 0
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params)]
    assert model._fused_decode_layers is not None  # decode steps took the one-call layers

    dense = LLM(str(path), quantization="none", **common)
    assert dense.engine.model.layers[0].self_attn.qkv_proj.packed is None
    assert got == [o.outputs[0].token_ids for o in dense.generate(prompts, params)]

    # The default dtype multiplies int8 activations (K codes' integer products at every level):
    # close to float32 in vLLM's sense (conftest.agreeing_prefix).
    fast = LLM(str(path), kv_cache_memory="4MiB", max_num_batched_tokens=32)
    fast_packed = fast.engine.model.layers[0].mlp.down_proj.packed
    assert fast_packed.int8_activations
    with_logprobs = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=TOP)

    def run(llm) -> list[dict]:
        outs = [o.outputs[0] for o in llm.generate(prompts, with_logprobs)]
        return [{"ids": o.token_ids, "logprobs": o.logprobs} for o in outs]

    for f, r in zip(run(fast), run(packed), strict=True):
        agreeing_prefix(f, r)
