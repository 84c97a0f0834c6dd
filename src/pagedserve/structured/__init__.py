"""Constrained decoding: grammars (JSON schema, regex, choice, Lark) compiled by llguidance,
one matcher per sequence, and the token bitmask applied to a step's logits.

`spec` is plain data (what SamplingParams carries); `compiler` and `masks` hold llguidance's
objects and are imported only by the engine.
"""
