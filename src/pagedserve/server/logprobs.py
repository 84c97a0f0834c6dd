"""Logprobs as the front ends show them: each token's text and bytes, ranked alternatives, and
one floor for a logprob that is not finite (JSON has no -inf), the same for every protocol."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import decoders

from pagedserve.outputs import TokenLogprobs

LOGPROB_FLOOR = -9999.0


class TokenText:
    """Each token's text and exact bytes, for logprobs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._byte_decoder: dict[str, int] | None = None
        # The decoder object, not the tokenizer's JSON (~0.1 s of a server's start to write and
        # parse for a vocabulary of 49k).
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if isinstance(decoder, decoders.ByteLevel):
            self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> tuple[int, ...]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self._byte_decoder is not None and piece and all(c in self._byte_decoder for c in piece):
            return tuple(self._byte_decoder[c] for c in piece)
        if piece and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return (int(piece[3:5], 16),)  # sentencepiece byte fallback
        return tuple(self._text(token_id).encode("utf-8"))


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


@dataclass
class Logprob:
    token_id: int
    token: str
    logprob: float


@dataclass
class PositionLogprobs:
    chosen: Logprob
    top: list[Logprob]  # best first


def _floor(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def format_logprobs(
    tokens: TokenText,
    token_ids: list[int],
    entries: list[TokenLogprobs],
    top_n: int | None = None,
) -> list[PositionLogprobs]:
    """One entry per generated token; `top_n` cuts the ranked list (None: every entry, which
    holds the requested top ones and the chosen token)."""
    text = tokens.text
    out = []
    for tid, entry in zip(token_ids, entries, strict=False):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        if top_n is not None:
            ranked = ranked[:top_n]
        out.append(
            PositionLogprobs(
                Logprob(tid, text(tid), _floor(entry.get(tid, LOGPROB_FLOOR))),
                [Logprob(t, text(t), _floor(v)) for t, v in ranked],
            )
        )
    return out
