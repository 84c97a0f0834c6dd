"""Prompts for `bench serve`: the shipped set (prompts.jsonl beside this module), any JSON-lines
file, or synthetic prompts of an exact token length."""

from __future__ import annotations

import functools
import json
import random
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULT_DATASET = Path(str(resources.files("pagedserve.bench") / "prompts.jsonl"))


def load_dataset(path: str | None) -> list[str]:
    """Prompts from a JSON-lines file, one object with a "prompt" field per line."""
    p = Path(path) if path else DEFAULT_DATASET
    if not p.is_file():
        raise ValueError(f"dataset {str(p)!r} not found (pass --dataset FILE.jsonl)")
    prompts = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{p}:{n}: expected a JSON object with a 'prompt'") from None
    if not prompts:
        raise ValueError(f"dataset {str(p)!r} holds no prompts")
    return prompts


def _word_tokens(tokenizer: Any) -> list[str]:
    """Vocabulary entries ' word' that encode back to exactly one token.

    Joined together, such pieces tokenize to exactly one token each (the pre-tokenizer splits at
    the spaces), so a synthetic prompt of L pieces is L tokens long.
    """
    ids = list(range(len(tokenizer)))
    special = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in ids])
    cands = [
        (i, t)
        for i, t in zip(ids, texts, strict=True)
        if i not in special and len(t) > 2 and t[0] == " " and t[1:].isascii() and t[1:].isalpha()
    ]
    encoded = tokenizer([t for _, t in cands], add_special_tokens=False)["input_ids"]
    words = [t for (i, t), enc in zip(cands, encoded, strict=True) if enc == [i]]
    if len(words) < 100:
        raise ValueError("the tokenizer has too few single-token words for synthetic prompts")
    return words


@functools.lru_cache(maxsize=2)
def tokenizer_words(tokenizer_path: str | None) -> tuple[Any, list[str]]:
    """The tokenizer (None: the default model's) and its single-token words; slow, so cached."""
    from pagedserve.models.loader import ModelSource, load_tokenizer

    tokenizer = load_tokenizer(ModelSource.resolve(tokenizer_path))
    return tokenizer, _word_tokens(tokenizer)


def synthetic_prompts(n: int, input_len: int, seed: int, tokenizer_path: str | None) -> list[str]:
    if input_len < 1:
        raise ValueError("--synthetic-input-len must be >= 1")
    _, words = tokenizer_words(tokenizer_path)
    rng = random.Random(seed)
    return ["".join(rng.choices(words, k=input_len)) for _ in range(n)]
