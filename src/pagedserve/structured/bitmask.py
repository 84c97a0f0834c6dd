"""The token bitmask of a step's constrained rows, applied to the logits as one tensor op."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass
class StepMask:
    rows: torch.Tensor  # [R] long: which of the step's sampling rows have a grammar
    bits: torch.Tensor  # [R, ceil(vocab / 32)] int32: bit t % 32 of word t // 32 = token t allowed


def allowed_tokens(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] bool from the packed words (little-endian bits, llguidance's layout)."""
    return ((bits.unsqueeze(-1) >> _SHIFTS) & 1).bool().flatten(1)[:, :vocab]


def apply_bitmask(logits: torch.Tensor, mask: StepMask) -> torch.Tensor:
    """The logits with the constrained rows' disallowed tokens at -inf; other rows untouched.
    (Out of place: the runner's logits are inference tensors.)"""
    banned = torch.zeros(logits.shape, dtype=torch.bool)
    banned[mask.rows] = ~allowed_tokens(mask.bits, logits.shape[1])
    return logits.masked_fill(banned.to(logits.device), float("-inf"))


def rows_without_tokens(logits: torch.Tensor, mask: StepMask) -> list[int]:
    """Constrained rows where nothing is left to sample (a grammar dead end)."""
    dead = torch.isneginf(logits[mask.rows]).all(dim=-1)
    return mask.rows[dead].tolist()
