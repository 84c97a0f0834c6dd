"""Which part of every weight a tensor-parallel rank holds: pure arithmetic, no processes.

Megatron's split: q/k/v and gate/up are cut by output rows (column-parallel), o and down by
input columns (row-parallel, summed by an all-reduce), embedding and lm_head by vocabulary rows.

Heads go to ranks in whole KV groups, so a rank's query heads always read its own KV heads and
the attention backends run unchanged on a rank's share. When the KV heads do not divide evenly
(SmolLM2's 3 KV heads over 2 ranks) the groups are shared out as evenly as they go (2 and 1):
the sums stay exact, only the work is uneven. With fewer KV heads than ranks, each KV head is
replicated on `size / num_kv_heads` ranks, which split its query heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedserve.models.config import ModelConfig


@dataclass(frozen=True)
class Range:
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def scaled(self, factor: int) -> Range:
        return Range(self.start * factor, self.stop * factor)


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor a rank reads: [start, stop) along `dim`."""

    dim: int
    start: int
    stop: int


def _balanced(n: int, parts: int, index: int) -> Range:
    """The index-th of `parts` contiguous ranges covering n, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return Range(start, start + base + (index < extra))


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    head_dim: int
    q_heads: Range  # query heads this rank computes
    kv_heads: Range  # KV heads it holds (and caches)
    intermediate: Range
    vocab: Range

    @classmethod
    def for_rank(cls, cfg: ModelConfig, size: int, rank: int) -> ShardPlan:
        """Raises ValueError when `size` cannot split this model."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of size {size}")
        heads, kv = cfg.num_heads, cfg.num_kv_heads
        group = heads // kv  # query heads per KV head
        if kv >= size:
            kv_heads = _balanced(kv, size, rank)
            q_heads = kv_heads.scaled(group)
        else:
            sharing = size // kv  # ranks holding a copy of one KV head
            if size % kv or group % sharing:
                raise ValueError(
                    f"tensor_parallel_size {size} cannot split this model's {heads} attention "
                    f"heads over {kv} KV heads: with fewer KV heads than ranks, the size must be "
                    f"a multiple of the KV heads ({kv}) that divides the heads ({heads})"
                )
            kv_head = rank // sharing
            kv_heads = Range(kv_head, kv_head + 1)
            per_rank = group // sharing
            start = kv_head * group + (rank % sharing) * per_rank
            q_heads = Range(start, start + per_rank)
        for what, n in (
            ("intermediate_size", cfg.intermediate_size),
            ("vocab_size", cfg.vocab_size),
        ):
            if n % size:
                raise ValueError(
                    f"tensor_parallel_size {size} does not divide this model's {what} ({n})"
                )
        return cls(
            rank=rank,
            size=size,
            head_dim=cfg.head_dim,
            q_heads=q_heads,
            kv_heads=kv_heads,
            intermediate=_balanced(cfg.intermediate_size, size, rank),
            vocab=_balanced(cfg.vocab_size, size, rank),
        )

    @classmethod
    def check(cls, cfg: ModelConfig, size: int) -> list[ShardPlan]:
        """Every rank's plan: fails (ValueError) before any process is started."""
        return [cls.for_rank(cfg, size, r) for r in range(size)]

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model as this rank sees it: its heads, its MLP columns, its vocabulary rows."""
        return replace(
            cfg,
            num_heads=self.q_heads.size,
            num_kv_heads=self.kv_heads.size,
            intermediate_size=self.intermediate.size,
            vocab_size=self.vocab.size,
        )

    def checkpoint_shard(self, hf_name: str) -> Shard | None:
        """This rank's part of a Hugging Face-named checkpoint tensor; None: all of it."""
        parts = hf_name.split(".")
        if len(parts) < 2:
            return None
        module, kind = parts[-2], parts[-1]
        if module == "q_proj":
            rows = self.q_heads.scaled(self.head_dim)
        elif module in ("k_proj", "v_proj"):
            rows = self.kv_heads.scaled(self.head_dim)
        elif module in ("gate_proj", "up_proj"):
            rows = self.intermediate
        elif module in ("embed_tokens", "lm_head"):
            rows = self.vocab
        elif module == "o_proj" and kind == "weight":
            cols = self.q_heads.scaled(self.head_dim)
            return Shard(1, cols.start, cols.stop)
        elif module == "down_proj" and kind == "weight":
            return Shard(1, self.intermediate.start, self.intermediate.stop)
        else:
            return None  # norms: every rank holds them whole
        return Shard(0, rows.start, rows.stop)
