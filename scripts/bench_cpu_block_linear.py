"""Packed block-type linears (Q4_1 and Q8_0: `ops().quant_linear`) at the default model's
shapes, as a step calls them: the level's default dtype (bfloat16 where the CPU computes it
natively, else float32) and int8 products over quantized activations; best of rounds, ms a
call and GOP/s. With --builds, two builds (scripts/build_cpu_kernels_as.py) loaded into this
process are called alternately, each round, and compared.

    [PAGEDSERVE_CPU_ISA=LEVEL] python scripts/bench_cpu_block_linear.py [--rows 1,32,512]
        [--builds OLD.so,NEW.so [--no-check]]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from pagedserve.cpu_kernels import import_library, isa, ops
from pagedserve.models.quant_weight import PackedWeight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_quant_linear import quant_weight  # noqa: E402  (GGUF blocks of given codes)

# (name, outputs, inputs, bits): one layer's matrices and the Q8_0 lm_head.
SHAPES = [
    ("qkv", 960, 576, 4),
    ("o", 576, 576, 4),
    ("gate_up", 3072, 576, 4),
    ("down", 576, 1536, 4),
    ("lm_head", 49152, 576, 8),
]


def packed(n: int, k: int, bits: int, gen: torch.Generator) -> PackedWeight:
    groups = k // 32
    scales = torch.rand(n, groups, generator=gen) * 0.01
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        offsets = -torch.rand(n, groups, generator=gen) * 0.05
        weight = PackedWeight.pack([quant_weight(codes, scales, offsets)])
    else:
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        weight = PackedWeight.pack([quant_weight(codes, scales, None)])
    weight.int8_activations = True
    return weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32,512", help="rows of x (tokens in the step)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=10, help="calls timed per round")
    parser.add_argument("--builds", default=None, help="OLD.so,NEW.so: compare two builds")
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="skip the builds' equality check (where they take float and integer products)",
    )
    args = parser.parse_args()
    builds = [import_library(p) for p in args.builds.split(",")] if args.builds else [ops()]
    dtype = torch.bfloat16 if isa.native_bf16() else torch.float32
    gen = torch.Generator().manual_seed(0)
    weights = {name: (packed(n, k, bits, gen), n, k) for name, n, k, bits in SHAPES}
    unit = "GOP/s, old -> new" if args.builds else "ms a call (GOP/s)"
    print(f"kernel level {builds[0].kernel_level()}, {dtype} activations, {unit}:")
    print("| rows | " + " | ".join(weights) + " |")
    print("|---:|" + "---:|" * len(weights))
    for rows in map(int, args.rows.split(",")):
        cells = []
        for weight, n, k in weights.values():
            x = torch.randn(rows, k, generator=gen).to(dtype)
            call_args = weight.kernel_args(None)
            outputs = [kernels.quant_linear(x, *call_args) for kernels in builds]
            if not args.no_check:
                torch.testing.assert_close(outputs[-1], outputs[0], rtol=1e-4, atol=1e-3)
            best = [float("inf")] * len(builds)
            for _ in range(args.rounds):
                for i, kernels in enumerate(builds):
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        kernels.quant_linear(x, *call_args)
                    best[i] = min(best[i], (time.perf_counter() - start) / args.calls)
            gops = [2 * rows * n * k / b / 1e9 for b in best]
            if args.builds:
                cells.append(f"{gops[0]:.0f} -> {gops[1]:.0f} ({best[0] / best[1]:.2f}x)")
            else:
                cells.append(f"{best[0] * 1e3:.3f} ({gops[0]:.0f})")
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
