"""Measures the two grammar libraries the field uses (llguidance, xgrammar) on this project's
workload: the default model's tokenizer, JSON schemas like those of the structured tests, a
batch of 32 matchers. Reports compile time per schema and mask-fill time per decode step (all
32 rows filled by each library's parallel batch call), stepping the matchers along a valid
output so that the masks are those of real positions.

    pip install -e ".[bench]" && python benchmarks/grammar_backends.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from pagedserve.models.loader import ModelSource, load_config, load_tokenizer

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
            "owner": {
                "type": "object",
                "properties": {
                    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                    "active": {"type": "boolean"},
                },
                "required": ["email", "active"],
            },
        },
        "required": ["id", "color", "tags", "owner"],
    },
}
SAMPLES = {
    "flat": {"name": "Ada Lovelace", "age": 36},
    "nested": {
        "id": 42,
        "color": "green",
        "tags": ["x", "yz"],
        "owner": {"email": "ada@example.com", "active": True},
    },
}
BATCH = 32


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def bench_llguidance(tokenizer, vocab: int, name: str, schema: dict, tokens: list[int]):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    tok_ms = _ms(t0)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False}
    )
    t0 = time.perf_counter()
    first = llguidance.LLMatcher(lltok, grammar)
    compile_ms = _ms(t0)
    assert not first.is_error(), first.get_error()
    # The cache keeps a compiled matcher; each sequence gets a copy of it.
    matchers = [first.deep_copy() for _ in range(BATCH)]
    executor = llguidance.LLExecutor()
    mask = lt.allocate_token_bitmask(BATCH, vocab)

    def fill() -> None:
        lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def consume(m, tok) -> None:
        assert m.consume_token(tok), m.get_error()

    return tok_ms, compile_ms, _run(matchers, tokens, fill, consume, lambda m: m.reset())


def bench_xgrammar(tokenizer, vocab: int, name: str, schema: dict, tokens: list[int]):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tok_ms = _ms(t0)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":")
    )
    compile_ms = _ms(t0)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    batch = xgr.BatchGrammarMatcher()
    mask = xgr.allocate_token_bitmask(BATCH, vocab)

    def consume(m, tok) -> None:
        assert m.accept_token(tok)

    fill = lambda: batch.batch_fill_next_token_bitmask(matchers, mask)  # noqa: E731
    return tok_ms, compile_ms, _run(matchers, tokens, fill, consume, lambda m: m.reset())


def _run(matchers, tokens: list[int], fill, consume, reset) -> list[float]:
    """Per-step fill times over two passes of the sample, rows staggered by one token each
    (a batch's rows sit at different positions), each row restarting when it reaches the end."""
    steps = []
    pos = [i % len(tokens) for i in range(len(matchers))]
    for m, p in zip(matchers, pos, strict=True):
        for tok in tokens[:p]:
            consume(m, tok)
    for _ in range(2 * len(tokens)):
        t0 = time.perf_counter()
        fill()
        steps.append(_ms(t0))
        for i, m in enumerate(matchers):
            consume(m, tokens[pos[i]])
            pos[i] += 1
            if pos[i] == len(tokens):
                reset(m)
                pos[i] = 0
    return steps


def main() -> None:
    source = ModelSource.resolve(None)
    tokenizer = load_tokenizer(source)
    vocab = load_config(source).vocab_size
    torch.set_num_threads(1)
    print(f"tokenizer: {source.name}, vocab {vocab}; batch {BATCH}; times in ms")
    for lib, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        for name, schema in SCHEMAS.items():
            text = json.dumps(SAMPLES[name], separators=(",", ":"))
            tokens = tokenizer.encode(text, add_special_tokens=False)
            tok_ms, compile_ms, steps = fn(tokenizer, vocab, name, schema, tokens)
            print(
                f"{lib:10s} {name:7s} tokenizer init {tok_ms:7.1f}  compile {compile_ms:7.1f}  "
                f"mask/step@{BATCH}: median {statistics.median(steps):6.2f} "
                f"p90 {sorted(steps)[int(0.9 * len(steps))]:6.2f} max {max(steps):6.2f} "
                f"({len(steps)} steps)"
            )


if __name__ == "__main__":
    main()
