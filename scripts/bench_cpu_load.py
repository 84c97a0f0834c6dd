"""Model load time on CPU: `LLMEngine` built in process (tokenizer, weights read and packed,
KV pool), best and worst of a few, and the process's peak RSS. The default model (GGUF Q4_1
matrices and a Q8_0 embedding), or with --kquant a Q4_K_M-style GGUF of random blocks (Q4_K
matrices, Q6_K for the attention output, the FFN down projection and the output) written to a
temporary file: hidden 768, FFN 2048, 24 layers, vocabulary 32768 (K types need rows of whole
256s, which the default model's 576 are not), built by tests/test_kquant_linear.py's writer.

    [PAGEDSERVE_CPU_ISA=LEVEL] python scripts/bench_cpu_load.py [--kquant] [--repeat 3]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path


def write_kquant_model(path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_kquant_linear as writer

    writer.HIDDEN, writer.FFN, writer.HEADS, writer.KV_HEADS = 768, 2048, 12, 4
    writer.VOCAB, writer.LAYERS = 32768, 24
    writer.write_tiny_llama(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kquant", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from pagedserve import engine
    from pagedserve.config import EngineConfig
    from pagedserve.models.loader import ModelSource, load_tokenizer

    config = EngineConfig(kv_cache_memory="64MiB")
    with tempfile.TemporaryDirectory() as tmp:
        if args.kquant:
            path = Path(tmp) / "kquant.gguf"
            write_kquant_model(path)
            # The file holds no vocabulary: the default model's tokenizer stands in.
            tokenizer = load_tokenizer(ModelSource.resolve(None))
            engine.load_tokenizer = lambda source: tokenizer
            config = EngineConfig(model=str(path), kv_cache_memory="64MiB")
        seconds = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            built = engine.LLMEngine(config)
            seconds.append(time.perf_counter() - start)
            del built
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(
        f"{'Q4_K_M-style' if args.kquant else 'default'} model: LLMEngine built in "
        f"{min(seconds):.2f}-{max(seconds):.2f} s ({args.repeat} runs), peak RSS {peak_gb:.2f} GB"
    )


if __name__ == "__main__":
    main()
