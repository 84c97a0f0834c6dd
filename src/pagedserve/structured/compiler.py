"""Grammar compilation with llguidance: specs -> matchers, cached by spec, off the engine loop.

The serving layer awaits `compile_async` before it hands a request to the engine, so an invalid
grammar is a 400 before anything streams and a grammar that takes long to build holds only its
own request; the engine then finds the grammar in the cache. llguidance builds lexers lazily
(the first masks of a new grammar take longer than the rest) and drops the GIL while it works.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf

from pagedserve.structured.constraint import GrammarConstraint
from pagedserve.structured.spec import JSON_OPTIONS, StructuredSpec

CACHE_SIZE = 512


class GrammarError(ValueError):
    """The backend cannot build the grammar (its message says why, e.g. a keyword it lacks)."""


def llguidance_grammar(spec: StructuredSpec) -> str:
    """The spec in llguidance's serialized grammar form (checked when a matcher is built)."""
    if spec.kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(str(e)) from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        options = json.loads(spec.source)
        lark = "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


class GrammarCompiler:
    """Compiled grammars for one tokenizer. Thread-safe; the llguidance tokenizer (~0.5 s to
    build) is made on the first compile, so engines that never see a grammar never pay it."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        # spec -> a matcher in its start state (copied for each sequence) or the error message.
        self._cache: OrderedDict[StructuredSpec, llguidance.LLMatcher | str] = OrderedDict()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="pagedserve-grammar")

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def compile(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        """A fresh matcher for `spec` in its start state; raises GrammarError."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
        if hit is None:
            hit = self._build(spec)
            with self._lock:
                self._cache[spec] = hit
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise GrammarError(hit)
        return hit.deep_copy()

    def constraint(self, spec: StructuredSpec) -> GrammarConstraint:
        """A sequence's constraint for `spec`, in its start state; raises GrammarError."""
        return GrammarConstraint(self.compile(spec))

    def compile_async(self, spec: StructuredSpec) -> Future[llguidance.LLMatcher]:
        return self._pool.submit(self.compile, spec)

    def _build(self, spec: StructuredSpec) -> llguidance.LLMatcher | str:
        try:
            grammar = llguidance_grammar(spec)
        except GrammarError as e:
            return str(e)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        return matcher.get_error() if matcher.is_error() else matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
