"""The Llama family (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Tokens of all sequences in a step are one flat batch [T, hidden]; attention is the only place
that knows about sequences, through the backend and its per-step metadata.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.attention import AttentionBackend, AttentionMetadata
from pagedserve.attention.torch_backend import TorchAttentionBackend
from pagedserve.cpu_kernels import ops
from pagedserve.distributed import layers as tp_layers
from pagedserve.distributed.group import TPGroup
from pagedserve.models import layer_ops
from pagedserve.models.config import ModelConfig, UnsupportedModelError
from pagedserve.models.gguf_file import KQuantWeight, QuantWeight
from pagedserve.models.layer_ops import RopeStep
from pagedserve.models.linear import Embedding, Linear
from pagedserve.models.quant_weight import pack, packable


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual, (norm(x), x)."""
        if residual is None:
            return layer_ops.rms_norm(x, self.weight, self.eps), x
        return layer_ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported")


class Rotary(nn.Module):
    """Rotary embedding in the Hugging Face layout (halves rotated, not interleaved pairs)."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg, self.max_positions = cfg, max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device) -> None:
        """Fill the cos/sin tables (after the module was created on the meta device)."""
        pos = torch.arange(self.max_positions, dtype=torch.float64)
        freqs = torch.outer(pos, rope_inv_freq(self.cfg)).to(device)
        self.cos, self.sin = freqs.cos().float(), freqs.sin().float()

    def step(self, positions: torch.Tensor) -> RopeStep:
        return RopeStep(self.cos, self.sin, positions)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPGroup | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = tp_layers.column_linear(cfg.hidden_size, qkv_size, cfg.qkv_bias, tp)
        self.o_proj = tp_layers.row_linear(self.q_size, cfg.hidden_size, tp)
        self.backend = backend
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeStep,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = layer_ops.apply_rotary(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            rope,
        )
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.view(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = tp_layers.column_linear(cfg.hidden_size, 2 * inter, False, tp)
        self.down_proj = tp_layers.row_linear(inter, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(layer_ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPGroup | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, residual, rope, kv_cache, meta):
        """Pre-norm block in the (output, residual) form: the residual add is fused into the
        next norm. Returns this block's MLP output and the residual stream before it."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        tp: TPGroup | None = None,
    ):
        """With `tp`, `cfg` is this rank's share (ShardPlan.local_config) and the layers that
        cross ranks are the sharded types."""
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = tp_layers.embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = Rotary(cfg, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = tp_layers.lm_head(cfg.hidden_size, cfg.vocab_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share embedding and output matrix (again after moving off the meta device)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.step(positions)
        fused = self._fused_decode_layers if meta.num_decode_tokens == x.shape[0] else None
        if fused:
            for args, (k_cache, v_cache) in zip(fused, kv_caches, strict=True):
                x, residual = ops().decode_layer(
                    x, residual, *args, positions, rope.cos, rope.sin, k_cache, v_cache,
                    meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                )  # fmt: skip
        else:
            for layer, kv in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, rope, kv, meta)
        return self.norm(x, residual)[0]

    @functools.cached_property
    def _fused_decode_layers(self) -> list[tuple] | None:
        """Per layer, the arguments of the C++ decode_layer (cpu_kernels/cpu_ops.cpp), which
        runs a decode step's layer in one call; None unless every layer can: packed weights
        on one process, the fused CPU attention backend. (Built at the first forward, after
        loading.)"""
        args = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not (
                all(type(m) is Linear and m.packed is not None for m in linears)
                and isinstance(attn.backend, TorchAttentionBackend)
                and attn.backend.fused
            ):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            packed = tuple(m.packed.kernel_args(m.bias) for m in linears)
            heads = (attn.num_heads, attn.num_kv_heads, attn.scale)
            args.append((*norms, layer.input_layernorm.eps, *packed, *heads))
        return args

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- weights ---------------------------------------------------------------------------
    _STACKED = {  # HF name -> (our fused name, shard index)
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight | KQuantWeight]]
    ) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up into one matrix each.
        Quantized weights (QuantWeight, KQuantWeight) are packed for the CPU kernels, and their
        layers drop the dense matrix, which is made and copied only for a layer that cannot
        take them packed; a tied output matrix shares the embedding's."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        # layer -> its parts' expected_weights() names -> (checkpoint name, weight)
        quant_parts: dict[str, dict[str, tuple[str, QuantWeight | KQuantWeight]]] = {}
        for hf_name, weight in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if isinstance(weight, QuantWeight | KQuantWeight):
                key, target, _ = self._target(name)
                quant_parts.setdefault(target.rsplit(".", 1)[0], {})[key] = (name, weight)
                continue
            loaded.add(self._copy(params, name, weight))
        for module, shards in quant_parts.items():
            named = [shards[key] for key in sorted(shards)]  # fused parts in order: #0, #1, #2
            if self._use_packed(module, [w for _, w in named]):
                loaded.update(shards)
            else:
                loaded.update(self._copy(params, name, w.dense) for name, w in named)
        missing = [n for n in self.expected_weights() if n not in loaded]
        if missing:
            raise UnsupportedModelError(f"checkpoint lacks weights: {', '.join(missing[:5])}")

    def _target(self, name: str) -> tuple[str, str, tuple[int, int] | None]:
        """A checkpoint weight's name in expected_weights(), its parameter, and for a part of
        a fused matrix the rows it fills."""
        parts = name.split(".")
        fused = self._STACKED.get(parts[-2]) if len(parts) >= 2 else None
        if fused is None:
            return name, name, None
        target = ".".join(parts[:-2] + [fused[0], parts[-1]])
        return f"{target}#{fused[1]}", target, self._shard_range(fused[0], fused[1])

    def _copy(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str:
        key, target, rows = self._target(name)
        if target not in params:
            raise UnsupportedModelError(f"unexpected weight {name!r} in the checkpoint")
        param = params[target]
        if rows is not None:
            start, size = rows
            param.data[start : start + size].copy_(tensor)
            return key
        if param.shape != tensor.shape:
            raise UnsupportedModelError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        param.data.copy_(tensor)
        return key

    def _use_packed(self, name: str, parts: list[QuantWeight | KQuantWeight]) -> bool:
        """Whether layer `name` now multiplies by `parts` packed (all its parts quantized,
        of one type the kernels take)."""
        try:
            layer = self.get_submodule(name)
        except AttributeError:
            return False  # not ours: the dense copy says which weight was unexpected
        n_shards = {"qkv_proj": 3, "gate_up_proj": 2}.get(name.rsplit(".", 1)[-1], 1)
        if len(parts) != n_shards or not isinstance(layer, Linear | Embedding):
            return False
        if not packable(parts):
            return False  # mixed types, or a shape the kernels do not take
        packed = pack(parts)
        layer.use_packed(packed)
        if isinstance(layer, Embedding) and self.cfg.tie_word_embeddings:
            self.lm_head.use_packed(packed)
        return True

    def _shard_range(self, fused: str, index: int) -> tuple[int, int]:
        c = self.cfg
        if fused == "qkv_proj":
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][index]
        return (index * c.intermediate_size, c.intermediate_size)

    def expected_weights(self) -> list[str]:
        names = []
        for name, _ in self.named_parameters():
            if "qkv_proj" in name:
                names += [f"{name}#{i}" for i in range(3)]
            elif "gate_up_proj" in name:
                names += [f"{name}#{i}" for i in range(2)]
            else:
                names.append(name)
        return names
