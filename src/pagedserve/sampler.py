"""Next-token choice for every sampling row of a step, as tensor code over the whole batch.

Order per row: token constraints (the step's grammar masks), penalties, min_tokens ->
(greedy argmax) -> temperature -> min-p, top-k, top-p -> draw.
Seeded rows draw from their own generator, so their tokens do not depend on the rest of the
batch; the others share one draw over the batch.
Logprobs are those of the model's raw distribution (before penalties and temperature), after
the grammar's mask for constrained rows: the distribution they are sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.cpu_kernels import ops
from pagedserve.outputs import TokenLogprobs
from pagedserve.sequence import Sequence
from pagedserve.structured.bitmask import StepMask, apply_bitmask, rows_without_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # Rows whose grammar allowed no token: their sampled token is meaningless.
    dead_rows: list[int] = field(default_factory=list)


def _padded(rows: list[list[int]], vocab: int) -> torch.Tensor:
    """Token lists padded with `vocab` (an id past the end, dropped after scatter)."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [vocab] * (width - len(r)) for r in rows], dtype=torch.long)


def _token_counts(rows: list[list[int]], vocab: int) -> torch.Tensor:
    ids = _padded(rows, vocab)
    counts = torch.zeros(len(rows), vocab + 1)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Penalized logits in float32; `logits` itself where no row has a penalty."""
    vocab = logits.shape[1]
    rep = torch.tensor([s.params.repetition_penalty for s in seqs])
    pres = torch.tensor([s.params.presence_penalty for s in seqs])
    freq = torch.tensor([s.params.frequency_penalty for s in seqs])
    if (pres != 0).any() or (freq != 0).any():
        out_counts = _token_counts([s.output_token_ids for s in seqs], vocab)
        logits = logits.float() - freq[:, None] * out_counts - pres[:, None] * (out_counts > 0)
    if (rep != 1.0).any():
        seen = _token_counts([s.all_token_ids for s in seqs], vocab) > 0
        r, logits = rep[:, None], logits.float()
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, penalized, logits)
    return logits


def _block_stop_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> None:
    """Forbid EOS and stop tokens for rows still short of min_tokens."""
    for row, s in enumerate(seqs):
        if len(s.output_token_ids) < s.params.min_tokens:
            banned = s.params.stop_token_ids + ([] if s.params.ignore_eos else eos_ids)
            logits[row, banned] = float("-inf")


def _filter(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    top_k = torch.tensor([s.params.top_k for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs])
    min_p = torch.tensor([s.params.min_p for s in seqs])
    if (min_p > 0).any():
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    if (top_k > 0).any() or (top_p < 1).any():
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[1])[None, :]
        k = torch.where(top_k > 0, top_k, probs.shape[1])[:, None]
        drop = rank >= k
        cum = sorted_p.masked_fill(drop, 0.0).cumsum(dim=-1)
        total = cum[:, -1:]
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop |= (cum - sorted_p.masked_fill(drop, 0.0)) >= top_p[:, None] * total
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p.masked_fill(drop, 0.0))
    return probs


def _draw(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One token per row from `probs`; seeded rows draw from their own generator."""
    seeded = [row for row, s in enumerate(seqs) if s.generator is not None]
    tokens = (
        torch.multinomial(probs, 1).squeeze(1)
        if len(seeded) < len(seqs)
        else torch.empty(len(seqs), dtype=torch.long)
    )
    for row in seeded:
        tokens[row] = torch.multinomial(probs[row], 1, generator=seqs[row].generator)[0]
    return tokens


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (torch.argmax's choice); on CPU by a C++ kernel (torch's
    argmax is ~1 ms at batch 32 of a 49k vocabulary)."""
    return ops().argmax_rows(logits) if logits.is_cpu else logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int], mask: StepMask | None = None
) -> SamplerOutput:
    """logits: [len(seqs), vocab] for each sequence's last position, float32 (the output
    matrix's, models/linear.py; other dtypes are computed on in float32); `mask` constrains
    some of the rows."""
    if mask is not None:
        logits = apply_bitmask(logits, mask)
    raw = logits
    logits = apply_penalties(logits, seqs)
    if any(len(s.output_token_ids) < s.params.min_tokens for s in seqs):
        logits = logits.to(torch.float32, copy=True)
        _block_stop_tokens(logits, seqs, eos_ids)
    greedy = [s.params.greedy for s in seqs]
    best = _argmax(logits) if mask is not None or any(greedy) else None
    dead = rows_without_tokens(logits, best, mask) if mask is not None else []
    if dead:  # give them something finite to draw from; their tokens are dropped
        logits = logits.to(torch.float32, copy=True)
        logits[dead] = 0.0
    if all(greedy):  # (also no rows at all)
        tokens = _argmax(logits) if best is None else best
    else:
        temp = torch.tensor([max(s.params.temperature, 1e-5) for s in seqs])
        probs = _filter(torch.softmax(logits.float() / temp[:, None], dim=-1), seqs)
        tokens = _draw(probs, seqs)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy), best, tokens)
    token_list = tokens.tolist()

    want = [s.params.logprobs for s in seqs]
    logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
    if any(w is not None for w in want):
        lp = torch.log_softmax(raw.float(), dim=-1)
        k = max(w or 0 for w in want)
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (None, None)
        chosen = lp.gather(1, tokens[:, None]).squeeze(1).tolist()
        for row, w in enumerate(want):
            if w is None:
                continue
            entry: TokenLogprobs = {token_list[row]: chosen[row]}
            if w:
                for tid, val in zip(
                    top_ids[row, :w].tolist(), top_vals[row, :w].tolist(), strict=True
                ):
                    if val > float("-inf"):  # tokens a grammar forbids are not alternatives
                        entry.setdefault(tid, val)
            logprobs[row] = entry
    return SamplerOutput(token_list, logprobs, dead)
