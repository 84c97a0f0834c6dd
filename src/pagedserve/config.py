"""Every engine knob in one place; the CLI derives its flags from these fields."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as '512MiB', '2GiB' or '1000000'."""
    if isinstance(value, int):
        size = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).upper() not in _SIZE_UNITS:
            raise ValueError(f"kv_cache_memory: cannot parse size {value!r} (e.g. 512MiB, 2GiB)")
        size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if size <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return size


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineConfig:
    model: str | None = _opt(
        None, "Model: a Hugging Face directory, a .gguf file, or empty for the default model"
    )
    dtype: str = _opt(
        "auto",
        "Weight and activation dtype. On CPU, any but float32 named explicitly also multiplies"
        " GGUF's packed 4-bit matrices by activations quantized to int8 per group of 32, as"
        " llama.cpp does (2-3x faster linears, rounding of bfloat16's order)",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    quantization: str = _opt(
        "auto",
        "auto: on CPU in float32 or bfloat16, keep a GGUF's Q4_0/Q4_1/Q8_0 matrices packed"
        " (read at 4-8 bits a weight); none: dequantize every weight",
        choices=["auto", "none"],
    )
    device: str = _opt("auto", "Device: auto, cpu or cuda", choices=["auto", "cpu", "cuda"])
    block_size: int = _opt(16, "Tokens per KV cache page")
    kv_cache_dtype: str = _opt(
        "auto",
        "KV cache dtype. auto: the model's dtype, except 16-bit pages on a CPU where --dtype"
        " auto came out float32 (twice the tokens in the pool, attention math still in"
        " float32): float16 from the avx2 level on (llama.cpp's default), bfloat16 at the"
        " generic level. Another dtype than the model's: float16 or bfloat16 under a float32"
        " model on CPU; int8 under any model on CPU (one scale per token and KV head, as"
        " llama.cpp's q8_0 KV: half of 16-bit pages' bytes)",
        choices=["auto", "float32", "bfloat16", "float16", "int8"],
    )
    kv_cache_memory: str | None = _opt(
        None, "Bytes for the KV cache pool, e.g. 512MiB or 2GiB (CPU default: 512MiB)"
    )
    gpu_memory_utilization: float = _opt(
        0.9, "Fraction of GPU memory for weights, activations and KV cache"
    )
    max_model_len: int | None = _opt(
        None, "Longest prompt + output in tokens (default: the model's context, capped by the pool)"
    )
    max_num_batched_tokens: int = _opt(2048, "Token budget of one engine step")
    max_num_seqs: int = _opt(256, "Most sequences in one engine step")
    enable_prefix_caching: bool = _opt(True, "Share KV pages of identical prompt prefixes")
    attention_backend: str = _opt(
        "auto", "Attention implementation", choices=["auto", "torch", "triton"]
    )
    seed: int = _opt(0, "Seed of the engine's random generator for unseeded requests")
    num_threads: int | None = _opt(
        None,
        "CPU threads for torch, per tensor-parallel rank (default: torch's choice; with tensor"
        " parallelism on CPU, this host's cores shared out among its ranks)",
    )
    tensor_parallel_size: int = _opt(
        1,
        "Ranks (processes, one device each) that split every layer; rank 0 runs in the engine's"
        " process. Started on this host, or, when RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are"
        " set, by torchrun with pagedserve.distributed.launch (see README)",
    )
    tensor_parallel_timeout: float = _opt(
        120.0,
        "Seconds a tensor-parallel rank waits for its peers (start-up, model loading, one step)"
        " before the engine fails; a rank that exits is noticed within a second",
    )

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.tensor_parallel_timeout <= 0:
            raise ValueError("tensor_parallel_timeout must be positive")

    @property
    def kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_memory is None else parse_size(self.kv_cache_memory)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
