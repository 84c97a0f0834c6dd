"""Triton attention kernels against the torch reference, on CPU under Triton's interpreter.

Shapes are small on purpose: the interpreter runs each program in Python. With
PAGEDSERVE_TEST_DEVICE=cuda the same tests run the compiled kernels on a GPU instead
(scripts/gpu_check.sh); the torch reference always runs on CPU in fp32. The kernels are
also compiled (not run) for sm_90 in a subprocess, which catches what the interpreter lets
through (tile shapes tl.dot refuses, type errors in the compiled path).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

DEVICE_NAME = os.environ.get("PAGEDSERVE_TEST_DEVICE", "cpu")
if DEVICE_NAME == "cpu":
    # The interpreter is chosen when a kernel is decorated, so before the kernels are imported.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
if DEVICE_NAME != "cpu" and not torch.cuda.is_available():
    pytest.skip(
        f"PAGEDSERVE_TEST_DEVICE={DEVICE_NAME} but CUDA is not available", allow_module_level=True
    )
DEVICE = torch.device(DEVICE_NAME)

from paged_cases import NUM_KV_HEADS, Pool, make_meta  # noqa: E402
from pagedserve.attention import triton_kernels as tk  # noqa: E402
from pagedserve.attention.backend import AttentionMetadata  # noqa: E402
from pagedserve.attention.registry import get_backend  # noqa: E402
from pagedserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagedserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402


def dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies on the device under test (copies on CPU too: kernels write into caches)."""
    return [t.to(DEVICE, copy=True) for t in tensors]


TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def reference(q, pool: Pool, meta: AttentionMetadata, scale: float, k=None, v=None):
    """The torch backend (SDPA, unfused) in fp32 on copies of the caches: (output, k_cache,
    v_cache)."""
    if k is None:
        k = v = torch.empty(0, NUM_KV_HEADS, q.shape[2])
    kc, vc = pool.k.float().clone(), pool.v.float().clone()
    ref = TorchAttentionBackend(fused=False)
    ref.prepare(meta, pool.page_size, q.shape[1] // NUM_KV_HEADS)
    out = ref.forward(q.float(), k.float(), v.float(), kc, vc, meta, scale)
    return out, kc, vc


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# (GQA group, head_dim, dtype, page_size): every group, dim and dtype, pages smaller than,
# equal to and larger than a 64-key tile.
CASES = [
    (1, 64, torch.float32, 16),
    (3, 128, torch.float32, 4),
    (8, 64, torch.float32, 128),
    (1, 128, torch.float16, 16),
    (3, 64, torch.float16, 64),
    (8, 128, torch.bfloat16, 16),
    (3, 64, torch.bfloat16, 8),
]
CASE_IDS = [f"g{g}-d{d}-{str(dt)[6:]}-p{p}" for g, d, dt, p in CASES]


@pytest.mark.parametrize(("group", "head_dim", "dtype", "page_size"), CASES, ids=CASE_IDS)
def test_write_kv(group, head_dim, dtype, page_size):
    pool = Pool([7, 1, 19], page_size, head_dim, dtype)
    meta = make_meta(pool, [1, 1, 6], [7, 1, 19])
    t = meta.slot_mapping.numel()
    k = pool.randn(t, NUM_KV_HEADS, head_dim, dtype=dtype)
    v = pool.randn(t, NUM_KV_HEADS, head_dim, dtype=dtype)
    # One more token, a padding one (slot -1): it must write nothing.
    slots = torch.cat([meta.slot_mapping, torch.tensor([-1])])
    pad = torch.full((1, NUM_KV_HEADS, head_dim), 7.0, dtype=dtype)
    # k and v as strided views into one tensor, as the fused qkv projection hands them over.
    (kv,) = dev(torch.stack([torch.cat([k, pad]), torch.cat([v, pad])], 1))
    kc, vc = dev(pool.k, pool.v)
    tk.write_kv(kv[:, 0], kv[:, 1], kc, vc, slots.to(DEVICE))
    kc, vc = kc.cpu(), vc.cpu()
    ek, ev = pool.k.clone(), pool.v.clone()
    ek.view(-1, NUM_KV_HEADS, head_dim)[meta.slot_mapping] = k
    ev.view(-1, NUM_KV_HEADS, head_dim)[meta.slot_mapping] = v
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


@pytest.mark.parametrize(("group", "head_dim", "dtype", "page_size"), CASES, ids=CASE_IDS)
def test_decode(group, head_dim, dtype, page_size):
    context_lens = [1, 37, 130, 64]  # one key, odd lengths, a partly filled last page
    pool = Pool(context_lens, page_size, head_dim, dtype, seed=group)
    meta = make_meta(pool, [1] * len(context_lens), context_lens, write=False)
    scale = head_dim**-0.5
    q = pool.randn(len(context_lens), group * NUM_KV_HEADS, head_dim, dtype=dtype)
    expected, _, _ = reference(q, pool, meta, scale)
    out = tk.paged_decode_attention(
        *dev(q, pool.k, pool.v, meta.decode_block_tables, meta.decode_context_lens), scale, 130
    )
    assert_close(out.cpu(), expected, dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize(
    ("group", "head_dim", "dtype"),
    [(3, 64, torch.float32), (8, 128, torch.bfloat16), (1, 64, torch.float16)],
)
def test_decode_split_k(num_splits, group, head_dim, dtype):
    # The shortest sequence leaves later splits empty; the longest fills all of them.
    context_lens = [5, 150, 259]
    pool = Pool(context_lens, 16, head_dim, dtype, seed=num_splits)
    meta = make_meta(pool, [1] * len(context_lens), context_lens, write=False)
    scale = head_dim**-0.5
    q = pool.randn(len(context_lens), group * NUM_KV_HEADS, head_dim, dtype=dtype)
    expected, _, _ = reference(q, pool, meta, scale)
    out = tk.paged_decode_attention(
        *dev(q, pool.k, pool.v, meta.decode_block_tables, meta.decode_context_lens),
        scale,
        max(context_lens),
        num_splits=num_splits,
    )
    assert_close(out.cpu(), expected, dtype)


@pytest.mark.parametrize(("group", "head_dim", "dtype", "page_size"), CASES, ids=CASE_IDS)
def test_prefill(group, head_dim, dtype, page_size):
    # Chunks: a whole prompt, one after a cached prefix, one of odd length deep into its pages,
    # and a long one whose (query, head) rows span several row blocks.
    q_lens = [5, 17, 3, 70]
    context_lens = [5, 30, 101, 70]
    pool = Pool(context_lens, page_size, head_dim, dtype, seed=10 + group)
    meta = make_meta(pool, q_lens, context_lens, write=False)
    scale = head_dim**-0.5
    q = pool.randn(sum(q_lens), group * NUM_KV_HEADS, head_dim, dtype=dtype)
    expected, _, _ = reference(q, pool, meta, scale)
    starts = torch.cumsum(meta.prefill_q_lens, 0) - meta.prefill_q_lens
    tensors = (q, pool.k, pool.v, meta.prefill_block_tables, starts, meta.prefill_q_lens)
    out = tk.paged_prefill_attention(
        *dev(*tensors, meta.prefill_context_lens), scale, meta.prefill_max_q_len
    )
    assert_close(out.cpu(), expected, dtype)


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize(
    ("group", "head_dim", "dtype", "page_size"),
    [(3, 64, torch.float32, 16), (8, 128, torch.bfloat16, 8), (1, 64, torch.float16, 32)],
)
def test_backend_mixed_step(num_splits, group, head_dim, dtype, page_size):
    """A whole step through the backend: writes then attention, decodes and chunks together."""
    q_lens = [1, 1, 1, 9, 4]
    context_lens = [1, 20, 77, 9, 45]
    pool = Pool(context_lens, page_size, head_dim, dtype, seed=20 + group)
    meta = make_meta(pool, q_lens, context_lens)
    t, scale = sum(q_lens), head_dim**-0.5
    q = pool.randn(t, group * NUM_KV_HEADS, head_dim, dtype=dtype)
    k = pool.randn(t, NUM_KV_HEADS, head_dim, dtype=dtype)
    v = pool.randn(t, NUM_KV_HEADS, head_dim, dtype=dtype)
    expected, ek, ev = reference(q, pool, meta, scale, k, v)

    backend = TritonAttentionBackend(DEVICE, num_splits=num_splits)
    backend.prepare(meta, page_size, group)  # metadata stays on CPU, as the runner builds it
    q, k, v, kc, vc = dev(q, k, v, pool.k, pool.v)
    out = backend.forward(q, k, v, kc, vc, meta, scale)
    assert_close(out.cpu(), expected, dtype)
    assert_close(kc.cpu(), ek, dtype)
    assert_close(vc.cpu(), ev, dtype)
    # A second layer of the same step reuses the prepared tensors.
    assert backend.forward(q, k, v, kc, vc, meta, scale).shape == q.shape


def test_get_backend():
    assert get_backend("triton", DEVICE).name == "triton"
    with pytest.raises(ValueError, match="not available"):
        get_backend("flash", DEVICE)


def test_choose_num_splits():
    assert tk.choose_num_splits(256, 8, 8192, 132) == 1  # enough programs already
    assert tk.choose_num_splits(1, 8, 300, 132) == 1  # too short to pay for a reduction
    assert tk.choose_num_splits(1, 8, 8192, 132) == 32
    assert tk.choose_num_splits(4, 8, 2048, 132) == 8


def test_kernels_compile_for_sm90():
    """Compile (no GPU needed) every kernel for an H100/H200 in a fresh, uninterpreted process."""
    script = textwrap.dedent(
        """
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from pagedserve.attention import triton_kernels as K

        def build(fn, ptrs, consts):
            sig = {}
            for name in fn.arg_names:
                if name in consts:
                    sig[name] = "constexpr"
                elif name in ptrs:
                    sig[name] = ptrs[name]
                else:
                    sig[name] = "fp32" if name == "qk_scale" else "i32"
            src = ASTSource(fn, signature=sig, constexprs=consts)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            assert k.asm["cubin"]

        dt, i64 = "*bf16", "*i64"
        cache = {"k_cache_ptr": dt, "v_cache_ptr": dt, "block_tables_ptr": i64}
        build(K._kv_write_kernel,
              {"k_ptr": dt, "v_ptr": dt, "k_cache_ptr": dt, "v_cache_ptr": dt, "slot_ptr": i64},
              dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128))
        for split in (False, True):
            build(K._decode_kernel,
                  {"q_ptr": dt, **cache, "context_lens_ptr": i64,
                   "out_ptr": "*fp32" if split else dt, "lse_ptr": "*fp32"},
                  dict(GROUP=3, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64,
                       PAGE_SIZE=16, SPLIT=split, UPCAST=False, PRECISION="tf32"))
        build(K._split_reduce_kernel, {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": dt},
              dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=8))
        build(K._prefill_kernel,
              {"q_ptr": dt, **cache, "q_starts_ptr": i64, "q_lens_ptr": i64,
               "context_lens_ptr": i64, "out_ptr": dt},
              dict(GROUP=3, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, PAGE_SIZE=16,
                   UPCAST=False, PRECISION="tf32"))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_tiny_llama_greedy_matches_torch_backend(default_gguf, tmp_path):
    """The whole model through the Triton backend: the same greedy tokens as the torch one."""
    if DEVICE.type != "cpu":
        pytest.skip("the model runs on CPU here; scripts/gpu_check.sh runs it on the GPU")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from pagedserve import LLM, SamplingParams

    directory, name = os.path.split(default_gguf)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA 4
        head_dim=32,
        max_position_embeddings=256,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # wider than the default init, so greedy picks are not near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    shared = (
        "The history of the printing press begins in fifteenth century Germany, in the city of"
        " Mainz, where a craftsman"
    )
    prompts = [
        tokenizer.encode(shared + " Gutenberg"),
        tokenizer.encode("Once upon a time"),
        tokenizer.encode(shared + " a goldsmith"),  # a prefix-cache hit on full pages
        tokenizer.encode("1, 2, 3,"),
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        # A small token budget: chunked prefill beside decodes, in one step.
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            attention_backend=backend,
            kv_cache_memory="1MiB",
            max_num_batched_tokens=16,
        )
        assert llm.engine.backend.name == backend
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]
    assert all(len(t) == 8 for t in outputs["triton"])
