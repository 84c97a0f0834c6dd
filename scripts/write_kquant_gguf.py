"""Write a Q4_K_M-style GGUF of random blocks that pagedserve and llama.cpp's server both
serve, to compare their K-type speeds side by side: Q4_K matrices, Q6_K for the attention
output, the FFN down projection and the output (tests/test_kquant_linear.py's writer), hidden
768, FFN 2048, 12 heads (4 KV heads), 24 layers, context 2048 (0.19B parameters; K types need
rows of whole 256s, which the default model's 576 are not), and the default model's tokenizer
and vocabulary. Its text is noise; the work per token is a real model's.

    python scripts/write_kquant_gguf.py /tmp/kquant.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_kquant_linear as writer  # noqa: E402
from pagedserve.models.loader import default_model_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    args = parser.parse_args()
    writer.HIDDEN, writer.FFN, writer.HEADS, writer.KV_HEADS = 768, 2048, 12, 4
    writer.VOCAB, writer.LAYERS, writer.CONTEXT = 49152, 24, 2048
    writer.write_tiny_llama(args.path, tokenizer_of=default_model_path())


if __name__ == "__main__":
    main()
