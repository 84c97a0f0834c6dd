"""GGUF checkpoints: the config from metadata and dequantized, Hugging Face-named weights."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from pagedserve.models.config import ModelConfig, UnsupportedModelError

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
}

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(path: str) -> ModelConfig:
    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    names = {t.name for t in reader.tensors}
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    rope_type = _field(reader, f"{arch}.rope.scaling.type")
    rope_scaling = None
    if rope_type not in (None, "none"):
        rope_scaling = {
            "rope_type": rope_type,
            "factor": _field(reader, f"{arch}.rope.scaling.factor"),
            "original_max_position_embeddings": _field(
                reader, f"{arch}.rope.scaling.original_context_length"
            ),
        }
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_layers=_field(reader, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=_field(reader, f"{arch}.attention.key_length", hidden // heads),
        rms_norm_eps=_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=_field(reader, f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        eos_token_ids=[] if eos is None else [eos],
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    )


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no known role")
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows for its interleaved rotary layout."""
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def iter_weights(path: str, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    reader = GGUFReader(path)
    llama_layout = cfg.architecture == "LlamaForCausalLM"
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"GGUF tensor {t.name!r} uses quantization {qtype.name}, which is not supported "
                f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
            )
        shape = tuple(int(d) for d in reversed(t.shape))
        array = np.array(dequantize(t.data, qtype), dtype=np.float32).reshape(shape)
        name = hf_name(t.name)
        if llama_layout and ".attn_q." in t.name:
            array = _unpermute(array, cfg.num_heads)
        elif llama_layout and ".attn_k." in t.name:
            array = _unpermute(array, cfg.num_kv_heads)
        yield name, torch.from_numpy(array)
