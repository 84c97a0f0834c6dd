"""Sharded layer types, Megatron style. Each holds this rank's slice of its weight (loaded
pre-sliced, see sharding.py); the constructors below give the plain layer when `tp` is None, so
model code only picks its layers through them."""

from __future__ import annotations

import torch

from pagedserve.distributed.group import TPGroup
from pagedserve.models.linear import Embedding, Linear


class ColumnParallelLinear(Linear):
    """Output features split across ranks; the output stays split (the next layer is
    row-parallel or attention over this rank's heads), so there is nothing to communicate."""


class RowParallelLinear(Linear):
    """Input features split across ranks: each computes a partial product of the full output,
    and an all-reduce sums them. No bias: the Llama family's o and down projections have none."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup):
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class VocabParallelEmbedding(Embedding):
    """Rows [rank * n, (rank + 1) * n) of the vocabulary; other ids look up zeros, and an
    all-reduce assembles every token's row from the rank that holds it."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup):
        super().__init__(num_embeddings, embedding_dim)
        self.tp = tp
        self.vocab_start = tp.rank * num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = self.lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(Linear):
    """Logits of this rank's vocabulary rows, gathered to rank 0 (the sampler's); the other
    ranks return an empty tensor."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup):
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_to_first(super().forward(x))
        return logits if logits is not None else x.new_empty(0)


def column_linear(in_features: int, out_features: int, bias: bool, tp: TPGroup | None) -> Linear:
    if tp is None:
        return Linear(in_features, out_features, bias)
    return ColumnParallelLinear(in_features, out_features, bias)


def row_linear(in_features: int, out_features: int, tp: TPGroup | None) -> Linear:
    if tp is None:
        return Linear(in_features, out_features, bias=False)
    return RowParallelLinear(in_features, out_features, tp)


def embedding(num_embeddings: int, embedding_dim: int, tp: TPGroup | None) -> Embedding:
    if tp is None:
        return Embedding(num_embeddings, embedding_dim)
    return VocabParallelEmbedding(num_embeddings, embedding_dim, tp)


def lm_head(in_features: int, vocab_size: int, tp: TPGroup | None) -> Linear:
    """The output matrix: float32 logits (Linear.float_out)."""
    head = (
        Linear(in_features, vocab_size, bias=False)
        if tp is None
        else ParallelLMHead(in_features, vocab_size, tp)
    )
    head.float_out = True
    return head
