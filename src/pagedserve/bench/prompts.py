"""A varied prompt set written for these benchmarks (instructions, questions, code, prose)."""

from __future__ import annotations

TOPICS = [
    "the water cycle",
    "how a bicycle stays upright",
    "the history of the printing press",
    "why the sky is blue",
    "how vaccines train the immune system",
    "the rules of chess",
    "how compilers turn source code into machine code",
    "the causes of the French Revolution",
    "how solar panels produce electricity",
    "the life cycle of a star",
    "how to bake sourdough bread",
    "the difference between weather and climate",
    "how the internet routes a packet",
    "what a black hole is",
    "how bees make honey",
    "the basics of double-entry bookkeeping",
]

TEMPLATES = [
    "Explain {t} to a curious ten-year-old.",
    "Write a short essay about {t}. Start with an overview, then give three details.",
    "You are a patient teacher. A student asks you about {t}. They have read a little about it "
    "already but are confused by the details and would like a clear, structured answer with an "
    "example they can remember. Answer them.",
    "Summarize {t} in a few sentences, then list common misconceptions about it.",
]


def benchmark_prompts(n: int) -> list[str]:
    """n prompts cycling through topics and templates (prompts of roughly 10-60 tokens)."""
    out = []
    for i in range(n):
        template = TEMPLATES[(i // len(TOPICS)) % len(TEMPLATES)]
        out.append(template.format(t=TOPICS[i % len(TOPICS)]))
    return out
