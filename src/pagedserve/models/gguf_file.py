"""GGUF checkpoints: the config from metadata and dequantized, Hugging Face-named weights."""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from pagedserve.distributed.sharding import Shard
from pagedserve.models.config import ModelConfig, UnsupportedModelError
from pagedserve.models.gguf_index import GGUFIndex

logger = logging.getLogger(__name__)

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


# Types whose blocks are 32 codes with a scale (and an offset): value = code * d + m. Their
# matrices can stay packed (models/quant_weight.py); the value is the code width in bits.
QUANT_TYPES = {
    GGMLQuantizationType.Q4_0: 4,
    GGMLQuantizationType.Q4_1: 4,
    GGMLQuantizationType.Q8_0: 8,
}
QUANT_GROUP = 32
# K types (super-blocks of 256 values, 8 groups of 32 with 6-bit or int8 scales): code width.
K_QUANT_TYPES = {
    GGMLQuantizationType.Q4_K: 4,
    GGMLQuantizationType.Q5_K: 5,
    GGMLQuantizationType.Q6_K: 6,
}
K_SUPER = 256
# Float types: their dense form is their own, not a dequantization.
FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


@dataclass
class _FileBlocks:
    """A quantized GGUF matrix as its file's blocks, kept as they are for the CPU kernels to
    pack (models/quant_weight.py); its codes and scales, and `dense` (the matrix dequantized by
    gguf), are made only when asked for: a matrix the kernels take packed never needs `dense`,
    and the loader holds every layer's weights before packing them."""

    blocks: torch.Tensor  # uint8 [N, K / block size * block bytes], rows of blocks as in the file
    qtype: GGMLQuantizationType

    @property
    def shape(self) -> tuple[int, int]:
        rows, row_bytes = self.blocks.shape
        size, type_size = GGML_QUANT_SIZES[self.qtype]
        return rows, row_bytes // type_size * size

    @functools.cached_property
    def dense(self) -> torch.Tensor:
        """[N, K] float32, gguf's dequantization."""
        array = dequantize(self.blocks.numpy(), self.qtype).astype(np.float32, copy=False)
        return torch.from_numpy(array.reshape(self.shape))

    def permute_rows(self, n_heads: int) -> Self:
        return type(self)(torch.from_numpy(_unpermute(self.blocks.numpy(), n_heads)), self.qtype)

    def _split(self) -> np.ndarray:
        """The blocks, one a row."""
        return self.blocks.numpy().reshape(-1, GGML_QUANT_SIZES[self.qtype][1])


class QuantWeight(_FileBlocks):
    """Q4_0, Q4_1 or Q8_0: weight[n, k] = codes[n, k] * scale[n, g] (+ offset[n, g]) with
    g = k // 32."""

    @property
    def bits(self) -> int:
        return QUANT_TYPES[self.qtype]

    @functools.cached_property
    def _unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """codes, scale and offset: Q4_0 (d, 16 bytes), Q4_1 (d, m, 16 bytes) or Q8_0
        (d, 32 bytes) blocks of 32."""
        header = 4 if self.qtype == GGMLQuantizationType.Q4_1 else 2
        rows, blocks = self.shape[0], self._split()
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, header:]
        if self.qtype == GGMLQuantizationType.Q8_0:
            codes, m = qs.view(np.int8), None
        else:
            codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # low nibbles, then high
            m = -8 * d
            if self.qtype == GGMLQuantizationType.Q4_1:
                m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        return (
            torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)),
            torch.from_numpy(d.reshape(rows, -1)),
            None if m is None else torch.from_numpy(m.reshape(rows, -1)),
        )

    @property
    def codes(self) -> torch.Tensor:  # [N, K]: uint8 in 0..15 (4 bits) or int8 (8 bits)
        return self._unpacked[0]

    @property
    def scale(self) -> torch.Tensor:  # [N, K / 32] float32 (float16 values)
        return self._unpacked[1]

    @property
    def offset(self) -> torch.Tensor | None:  # [N, K / 32] float32, None for Q8_0
        return self._unpacked[2]

    def astuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.codes, self.scale, self.offset, self.dense) if t is not None)


class KQuantWeight(_FileBlocks):
    """Q4_K, Q5_K or Q6_K, as codes in their blocks' order (cpu_kernels/quant_layout.h):
    Q4_K/Q5_K: weight[n, k] = codes * d * subs[n, g, 0] - dmin * subs[n, g, 1], with
    (d, dmin) = supers[n, k // 256]; Q6_K: weight = (codes - 32) * d * int8(subs[n, g, h]),
    h the half of group g = k // 32 that k lies in."""

    @property
    def bits(self) -> int:
        return K_QUANT_TYPES[self.qtype]

    @functools.cached_property
    def _unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """codes [N, K] uint8 in 0 .. 2^bits - 1, subs [N, K / 32, 2] uint8 and supers
        [N, K / 256, 2 (Q4_K, Q5_K) or 1 (Q6_K)] float32 (float16 values), from Q4_K (d, dmin,
        12 bytes of 6-bit scales and mins, 128 of nibbles), Q5_K (the same and 32 bytes of fifth
        bits) or Q6_K (128 bytes of nibbles, 64 of 2-bit highs, 16 int8 scales, d) super-blocks
        of 256, in gguf.quants' order."""
        blocks = self._split()
        n = blocks.shape[0]

        def f16(b: np.ndarray) -> np.ndarray:
            return b.copy().view(np.float16).astype(np.float32)

        def nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:  # low, then high nibbles
            shifts = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
            return ((qs.reshape(n, -1, 1, chunk) >> shifts) & 0x0F).reshape(n, K_SUPER)

        if self.qtype == GGMLQuantizationType.Q6_K:
            ql, qh, scales, d = np.split(blocks, [128, 192, 208], axis=1)
            shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
            high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, K_SUPER)
            codes = nibbles(ql, 64) | (high << 4)
            subs = scales.reshape(n, 8, 2)  # int8 scales of 16 values: each group's two halves
            supers = f16(d).reshape(n, 1)
        else:
            d, dmin, scales, qs = np.split(blocks, [2, 4, 16], axis=1)
            codes = nibbles(qs[:, -128:], 32)
            if self.qtype == GGMLQuantizationType.Q5_K:
                shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
                high = ((qs[:, :32].reshape(n, 1, 32) >> shifts) & 0x01).reshape(n, K_SUPER)
                codes = codes | (high << 4)
            sc, mn = Q4_K.get_scale_min(scales)
            subs = np.stack([sc, mn], axis=-1).astype(np.uint8)
            supers = np.stack([f16(d), f16(dmin)], axis=-1).reshape(n, 2)
        rows, k = self.shape
        return (
            torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, k)),
            torch.from_numpy(np.ascontiguousarray(subs).reshape(rows, k // QUANT_GROUP, 2)),
            torch.from_numpy(np.ascontiguousarray(supers).reshape(rows, k // K_SUPER, -1)),
        )

    @property
    def codes(self) -> torch.Tensor:
        return self._unpacked[0]

    @property
    def subs(self) -> torch.Tensor:
        return self._unpacked[1]

    @property
    def supers(self) -> torch.Tensor:
        return self._unpacked[2]

    def astuple(self) -> tuple[torch.Tensor, ...]:
        return self.codes, self.subs, self.supers, self.dense


# What keep_quant yields a matrix of each type the CPU kernels pack as.
_KEPT_AS_BLOCKS: dict[GGMLQuantizationType, type[_FileBlocks]] = {
    **dict.fromkeys(QUANT_TYPES, QuantWeight),
    **dict.fromkeys(K_QUANT_TYPES, KQuantWeight),
}


@functools.lru_cache(maxsize=1)
def _index(path: str) -> GGUFIndex:
    """One index of a file for its config and then its weights (iter_weights drops it)."""
    return GGUFIndex.load(path)


def read_config(path: str) -> ModelConfig:
    index = _index(path)
    field = index.field
    arch = field("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    names = {t.name for t in index.tensors}
    heads = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    vocab = field(f"{arch}.vocab_size") or index.array_lengths.get("tokenizer.ggml.tokens")
    rope_type = field(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if rope_type not in (None, "none"):
        rope_scaling = {
            "rope_type": rope_type,
            "factor": field(f"{arch}.rope.scaling.factor"),
            "original_max_position_embeddings": field(
                f"{arch}.rope.scaling.original_context_length"
            ),
        }
    eos = field("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_layers=field(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=field(f"{arch}.attention.head_count_kv", heads),
        head_dim=field(f"{arch}.attention.key_length", hidden // heads),
        rms_norm_eps=field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=field(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        eos_token_ids=[] if eos is None else [eos],
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
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


def _read_shard(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], shard: Shard | None
) -> tuple[np.ndarray, tuple[int, ...], Shard | None]:
    """The stored data of a rank's shard of a tensor, and its shape, read without the rest
    (the file is memory-mapped): whole rows, or whole quantization blocks of every row. A shard
    that would split blocks comes back whole, with the cut left to make after dequantizing."""
    if shard is None:
        return data, shape, None
    n = shard.stop - shard.start
    if shard.dim == 0 and data.shape[0] == shape[0]:
        return data[shard.start : shard.stop], (n, *shape[1:]), None
    block, type_size = GGML_QUANT_SIZES[qtype]
    if shard.dim == 1 and len(shape) == 2 and shard.start % block == shard.stop % block == 0:
        if data.shape[-1] == shape[-1]:  # stored element by element
            return data[:, shard.start : shard.stop], (shape[0], n), None
        start, stop = shard.start // block * type_size, shard.stop // block * type_size
        return data[:, start:stop], (shape[0], n), None
    return data, shape, shard


def iter_weights(
    path: str,
    cfg: ModelConfig,
    keep_quant: bool = False,
    shard_of: Callable[[str], Shard | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor | QuantWeight | KQuantWeight]]:
    """HF-named weights; with keep_quant, Q4_0/Q4_1/Q8_0 matrices come as QuantWeight and
    Q4_K/Q5_K/Q6_K ones as KQuantWeight (their blocks, mapped from the file), for the CPU
    kernels; other quantized types are dequantized, said in one log line.
    `shard_of` names the part of each tensor to read (a tensor-parallel rank's)."""
    index = _index(path)
    file = np.memmap(path, mode="c")  # copy on write: torch takes its views (never written)
    dequantized: collections.Counter[str] = collections.Counter()
    llama_layout = cfg.architecture == "LlamaForCausalLM"
    for t in index.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"GGUF tensor {t.name!r} uses quantization {qtype.name}, which is not supported "
                f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
            )
        name = hf_name(t.name)
        shard = shard_of(name) if shard_of is not None else None
        data, shape, cut = _read_shard(t.data(file), qtype, tuple(reversed(t.shape)), shard)
        # q/k rows are reordered within each head, so a shard of whole heads unpermutes alone.
        rows = shape[0] if cut is None or cut.dim != 0 else cut.stop - cut.start
        heads = None
        if llama_layout and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = rows // cfg.head_dim
        if keep_quant and cut is None and len(shape) == 2:
            kind = _KEPT_AS_BLOCKS.get(qtype)
            if kind is not None:
                weight = kind(torch.from_numpy(np.ascontiguousarray(data)), qtype)
                yield name, weight if heads is None else weight.permute_rows(heads)
                continue
        if keep_quant and qtype not in FLOAT_TYPES | QUANT_TYPES.keys() | K_QUANT_TYPES.keys():
            dequantized[qtype.name] += 1
        array = np.array(dequantize(data, qtype), dtype=np.float32).reshape(shape)
        if cut is not None:
            array = array[cut.start : cut.stop] if cut.dim == 0 else array[:, cut.start : cut.stop]
        yield name, torch.from_numpy(array if heads is None else _unpermute(array, heads))
    del file  # every weight is copied out: let the file's mapping go
    _index.cache_clear()
    if dequantized:
        from pagedserve.cpu_kernels.isa import kernel_level

        types = ", ".join(
            f"{t} ({n} tensor{'s' if n > 1 else ''})" for t, n in sorted(dequantized.items())
        )
        logger.info(
            "dequantized at load, no packed kernel at the %s level: %s", kernel_level(), types
        )
