"""One way to load a model for the engine, in one process or in each tensor-parallel rank:
the model (or this rank's shard), then the KV pool sized to what is left, as a `ModelRunner`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve import cpu_kernels
from pagedserve.attention import get_backend
from pagedserve.config import EngineConfig
from pagedserve.distributed.sharding import ShardPlan
from pagedserve.model_runner import ModelRunner, kv_bytes_per_page
from pagedserve.models.config import ModelConfig
from pagedserve.models.loader import ModelSource, load_model

if TYPE_CHECKING:
    from pagedserve.distributed.group import TPGroup

# The pool is calloc'd, so only touched pages are resident; but prefix caching keeps freed
# pages' contents and hands out untouched pages first, so under sustained load the whole pool
# becomes resident. 512 MiB (23,296 tokens of the default model: 64 sequences of ~360 tokens)
# keeps the default model's server under 1.5 GB resident.
CPU_DEFAULT_KV_BYTES = 512 << 20


@dataclass
class LoadSpec:
    """What every process needs to load its model; rank 0 (the engine) sends it to the others."""

    config: EngineConfig
    source: ModelSource
    model_config: ModelConfig
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV pages'
    device_type: str
    max_positions: int
    keep_quant: bool = False
    int8_activations: bool = False


def load_runner(spec: LoadSpec, device: torch.device, tp: TPGroup | None = None) -> ModelRunner:
    """Load the model (with `tp`, this rank's shard), then size the KV pool. Under tensor
    parallelism every rank holds the same number of pages (they share the block tables): the
    most that fits on every rank."""
    config, cfg, dtype = spec.config, spec.model_config, spec.dtype
    local = cfg if tp is None else ShardPlan.for_rank(cfg, tp.size, tp.rank).local_config(cfg)
    if device.type == "cpu":
        # Built (or found built) before the model loads, so that a server, or a tensor-parallel
        # rank, is ready only once its kernels are: a stale build otherwise ran inside the first
        # step (minutes on two cores, past a collective's timeout on a rank).
        cpu_kernels.ops()
    backend = get_backend(config.attention_backend, device)
    model = load_model(
        spec.source,
        cfg,
        backend,
        dtype,
        device,
        spec.max_positions,
        spec.keep_quant,
        tp=tp,
        int8_activations=spec.int8_activations,
    )
    per_page = kv_bytes_per_page(local, config.block_size, spec.kv_dtype)
    num_pages = kv_budget_bytes(config, model, local, dtype, device) // per_page
    if tp is not None:
        num_pages = tp.min_int(num_pages)
    if num_pages < 1:
        raise ValueError("kv_cache_memory is too small for a single KV page")
    return ModelRunner(model, local, backend, num_pages, config.block_size, spec.kv_dtype, device)


def kv_budget_bytes(
    config: EngineConfig,
    model: torch.nn.Module,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Bytes for KV pages on `device`, after the model's weights (a rank's shard under TP)."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    # Free memory after the weights, less headroom for activations of a full step.
    torch.cuda.synchronize()
    total = torch.cuda.get_device_properties(device).total_memory
    activation_headroom = _profile_peak_activation_bytes(config, model, cfg, dtype, device)
    budget = total * config.gpu_memory_utilization
    return int(budget - torch.cuda.memory_allocated() - activation_headroom)


def _profile_peak_activation_bytes(
    config: EngineConfig,
    model: torch.nn.Module,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Peak extra memory of a forward at the full token budget (no KV pages yet)."""
    n = config.max_num_batched_tokens
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.inference_mode():
        x = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        for layer in model.layers:
            x = layer.mlp(layer.post_attention_layernorm(x))
        model.compute_logits(x[-min(n, config.max_num_seqs) :])
    return torch.cuda.max_memory_allocated() - before
