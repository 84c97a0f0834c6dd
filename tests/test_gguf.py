"""GGUF reading: dequantized weights, and clear errors for what is not supported."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from pagedserve.models import gguf_file
from pagedserve.models.config import UnsupportedModelError


def write_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_context_length(128)
    w.add_vocab_size(64)
    for name, (array, qtype) in tensors.items():
        # uint8 arrays are already-packed blocks; float ones are quantized here.
        data = (
            array
            if array.dtype == np.uint8 or qtype == GGMLQuantizationType.F32
            else (quantize(array, qtype))
        )
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    "qtype,tol",
    [
        (GGMLQuantizationType.F32, 0.0),
        (GGMLQuantizationType.F16, 1e-3),
        (GGMLQuantizationType.BF16, 1e-2),
        (GGMLQuantizationType.Q8_0, 2e-2),
        (GGMLQuantizationType.Q4_0, 0.2),
        (GGMLQuantizationType.Q4_1, 0.2),
    ],
)
def test_dequantized_weights_match_originals(tmp_path, qtype, tol):
    rng = np.random.default_rng(0)
    array = rng.standard_normal((64, 32)).astype(np.float32)
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", {"token_embd.weight": (array, qtype)})
    cfg = gguf_file.read_config(str(path))
    (name, tensor), *_ = list(gguf_file.iter_weights(str(path), cfg))
    assert name == "model.embed_tokens.weight" and tensor.shape == (64, 32)
    assert torch.allclose(tensor, torch.from_numpy(array), atol=tol * 4, rtol=0)


def test_unsupported_quantization_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    raw = np.zeros((64, 84), dtype=np.uint8)  # one Q2_K block (84 bytes) per row of 256
    write_gguf(path, "llama", {"token_embd.weight": (raw, GGMLQuantizationType.Q2_K)})
    with pytest.raises(UnsupportedModelError, match="Q2_K.*not supported"):
        list(gguf_file.iter_weights(str(path), gguf_file.read_config(str(path))))


def test_types_without_a_packed_kernel_are_dequantized_in_one_log_line(tmp_path, caplog):
    """Kept quantized where a kernel takes them (Q4_1, Q4_K); Q5_0 and Q5_1 dequantized, said
    once for the whole file with the kernel level; float types are no dequantization."""
    from pagedserve.cpu_kernels.isa import kernel_level

    rng = np.random.default_rng(0)
    array = rng.standard_normal((64, 256)).astype(np.float32)
    q4_k = rng.integers(0, 256, (64, 144), dtype=np.uint8)  # one Q4_K block per row
    q4_k[:, :4] = np.full((64, 2), 1e-3, dtype=np.float16).view(np.uint8)  # d, dmin
    tensors = {
        "token_embd.weight": (array, GGMLQuantizationType.Q5_0),
        "output.weight": (array, GGMLQuantizationType.Q5_1),
        "blk.0.attn_q.weight": (array, GGMLQuantizationType.Q4_1),
        "blk.0.attn_k.weight": (q4_k, GGMLQuantizationType.Q4_K),
        "blk.0.attn_v.weight": (array, GGMLQuantizationType.Q5_0),
        "blk.0.attn_norm.weight": (array[0], GGMLQuantizationType.F32),
    }
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", tensors)
    cfg = gguf_file.read_config(str(path))
    with caplog.at_level("INFO", logger="pagedserve.models.gguf_file"):
        weights = dict(gguf_file.iter_weights(str(path), cfg, keep_quant=True))
    assert isinstance(weights["model.layers.0.self_attn.q_proj.weight"], gguf_file.QuantWeight)
    assert isinstance(weights["model.layers.0.self_attn.k_proj.weight"], gguf_file.KQuantWeight)
    assert isinstance(weights["model.embed_tokens.weight"], torch.Tensor)
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert lines == [
        f"dequantized at load, no packed kernel at the {kernel_level()} level: "
        "Q5_0 (2 tensors), Q5_1 (1 tensor)"
    ]


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "gpt2", {})
    with pytest.raises(UnsupportedModelError, match="gpt2.*not supported"):
        gguf_file.read_config(str(path))


def test_quantized_codes_reproduce_the_dequantized_weights(default_gguf):
    """GGUF matrices kept as codes (Q4_1, and the Q8_0 embedding): same dense values as the
    plain path, and packed for the CPU kernels they compute the same products."""
    from pagedserve.models.quant_weight import PackedWeight

    cfg = gguf_file.read_config(default_gguf)
    plain = gguf_file.iter_weights(default_gguf, cfg)
    kept = gguf_file.iter_weights(default_gguf, cfg, keep_quant=True)
    seen = 0
    names = ("embed_tokens.weight", "q_proj.weight", "k_proj.weight", "down_proj.weight")
    for (name, dense), (name_q, weight) in zip(plain, kept, strict=True):
        assert name == name_q
        if not isinstance(weight, gguf_file.QuantWeight):
            continue
        assert torch.equal(weight.dense, dense), name  # includes q/k row permutation
        assert weight.bits == (8 if "embed_tokens" in name else 4), name
        if seen < 4 and name.endswith(names):
            x = torch.randn(5, dense.shape[1]).to(torch.bfloat16)
            got = PackedWeight.pack([weight]).linear(x, None).float()
            torch.testing.assert_close(got, x.float() @ dense.t(), atol=0.05, rtol=0.02)
            seen += 1
    assert seen == 4


def test_decode_layers_in_one_call_match_the_module_path(monkeypatch):
    """Decode steps of the default model (packed weights) run each layer as one C++ call; the
    tokens are those of the module-by-module path, step for step."""
    from conftest import PROMPTS
    from pagedserve import LLM, SamplingParams
    from pagedserve.models.llama import LlamaForCausalLM

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(kv_cache_memory="64MiB")
    fused = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)]
    assert llm.engine.model._fused_decode_layers is not None  # the path ran
    monkeypatch.setattr(LlamaForCausalLM, "_fused_decode_layers", None)
    llm = LLM(kv_cache_memory="64MiB")
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)] == fused


def test_a_saved_index_replaces_the_parse(tmp_path, monkeypatch):
    """The second read of a file takes its config and weights from the saved index (no parse
    of the metadata), equal to the first; a rewritten file is parsed afresh."""
    from pagedserve.models.gguf_index import GGUFIndex

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    q8, q4, f32 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.F32
    tensors = {
        "token_embd.weight": (rng.standard_normal((64, 32)).astype(np.float32), q8),
        "blk.0.attn_q.weight": (rng.standard_normal((32, 32)).astype(np.float32), q4),
        "blk.0.attn_norm.weight": (np.ones(32, dtype=np.float32), f32),
    }
    path = str(tmp_path / "m.gguf")
    write_gguf(path, "llama", tensors)

    def read():
        cfg = gguf_file.read_config(path)
        return cfg, [
            (n, w.dense if hasattr(w, "dense") else w) for n, w in gguf_file.iter_weights(path, cfg)
        ]

    parses = []
    real_parse = GGUFIndex.parse.__func__
    monkeypatch.setattr(
        GGUFIndex, "parse", classmethod(lambda cls, p: parses.append(p) or real_parse(cls, p))
    )
    cfg, weights = read()
    assert parses == [path] and list((tmp_path / "cache" / "pagedserve" / "gguf-index").iterdir())
    cfg2, weights2 = read()
    assert parses == [path] and cfg2 == cfg  # from the index
    assert [n for n, _ in weights2] == [n for n, _ in weights]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(weights, weights2, strict=True))

    tensors["blk.0.attn_norm.weight"] = (np.full(32, 2.0, dtype=np.float32), f32)
    write_gguf(path, "llama", tensors)
    os.utime(path, ns=(1, 1))  # a replaced file (its modification time differs)
    _, weights3 = read()
    assert parses == [path, path]
    assert torch.equal(
        dict(weights3)["model.layers.0.input_layernorm.weight"], torch.full((32,), 2.0)
    )
