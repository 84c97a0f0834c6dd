"""Packed K-quant linears (cpu_kernels/quant_linear*.cpp) against torch's dense float32 matmul,
for the default model's linear shapes (and its own block type, Q4_1, beside them), one
thread, interleaved A/B in one process (a shared machine's load then hits both sides alike:
quote the ratios, not the times).

    PAGEDSERVE_CPU_ISA=avx2 PYTHONPATH=src python benchmarks/bench_kquant_linear.py

The default model's 576 inputs are not whole super-blocks of 256 (GGUF files quantize such
matrices to other types); the packed matrices here are built from random codes and scales with
a last partial super-block, which the kernels take: the work per weight is a real one's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.cpu_kernels import kernel_level
from pagedserve.models.gguf_file import KQuantWeight, QuantWeight
from pagedserve.models.quant_weight import KPackedWeight, PackedWeight

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # [out, in]
ROWS = [1, 8, 32]
TYPES = {"Q4_1": 0, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}  # K types by code width


def random_packed(n: int, k: int, bits: int, gen: torch.Generator):
    if bits == 0:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scale, offset = torch.rand(n, k // 32, generator=gen), torch.rand(n, k // 32, generator=gen)
        return PackedWeight.pack([QuantWeight(codes, scale, offset, 4)])
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    subs = torch.randint(0, 64, (n, k // 32, 2), generator=gen, dtype=torch.uint8)
    supers = torch.rand(n, -(-k // 256), 1 if bits == 6 else 2, generator=gen) * 1e-3
    return KPackedWeight.pack([KQuantWeight(codes, subs, supers, torch.empty(0), bits)])


def timed(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def ratio(
    packed: PackedWeight | KPackedWeight, dense: torch.Tensor, x: torch.Tensor, rounds: int
) -> float:
    """Median dense time / median packed time, the two timed in turn `rounds` times."""
    cases = {
        "packed": lambda: packed.linear(x, None),
        "dense": lambda: torch.nn.functional.linear(x, dense),
    }
    # Repeats per timing: about 20 ms of the slower side.
    per_call = max(timed(f, 1) for f in cases.values())
    repeats = max(1, int(0.02 / max(per_call, 1e-6)))
    times: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(rounds):
        for case, fn in cases.items():
            times[case].append(timed(fn, repeats))
    return statistics.median(times["dense"]) / statistics.median(times["packed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="A/B rounds per case (median)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"kernel level {kernel_level()}, 1 thread; ratio = dense float32 time / packed time")
    print("| type | shape (out x in) | " + " | ".join(f"{r} rows" for r in ROWS) + " |")
    print("|---|---|" + "---|" * len(ROWS))
    for name, bits in TYPES.items():
        for n, k in SHAPES:
            packed = random_packed(n, k, bits, gen)
            dense = torch.randn(n, k, generator=gen)
            cells = " | ".join(
                f"{ratio(packed, dense, torch.randn(rows, k, generator=gen), args.rounds):.2f}x"
                for rows in ROWS
            )
            print(f"| {name} | {n} x {k} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
