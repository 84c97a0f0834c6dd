"""Packed K-quant linears (cpu_kernels/quant_linear*.cpp) against torch's dense float32 matmul,
with Q4_1 (the default model's block type) beside them, int8 activations as served, one
thread, interleaved A/B in one process (a shared machine's load then hits both sides alike:
quote the ratios, not the times).

    PAGEDSERVE_CPU_ISA=avx2 PYTHONPATH=src python benchmarks/bench_kquant_linear.py

Shapes of a Q4_K_M-style model of hidden size 768 (GGUF's K types take whole super-blocks of
256 inputs; the default model's 576 are not), random blocks: the work per weight is a real
one's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedserve.cpu_kernels import kernel_level
from pagedserve.models.gguf_file import KQuantWeight
from pagedserve.models.quant_weight import KPackedWeight, PackedWeight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_kquant_linear import random_blocks  # noqa: E402  (random K super-blocks)
from test_quant_linear import random_quant  # noqa: E402  (random Q4_1 blocks)

# [out, in]: a Q4_K_M-style model of hidden 768 (K types need whole super-blocks of 256).
SHAPES = [(768, 768), (2048, 768), (768, 2048), (32768, 768)]
ROWS = [1, 8, 32]
Q = GGMLQuantizationType
TYPES = ["Q4_1", "Q4_K", "Q5_K", "Q6_K"]


def random_packed(name: str, n: int, k: int, gen: torch.Generator):
    """Q4_1 or a K type of random blocks, with int8 activations as the default dtype serves
    them (where the level has integer products for the codes; float ones elsewhere)."""
    if name == "Q4_1":
        weight = PackedWeight.pack([random_quant(n, k, 4, gen)])
    else:
        rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
        blocks = random_blocks(Q[name], n, k, rng)
        weight = KPackedWeight.pack([KQuantWeight(torch.from_numpy(blocks), Q[name])])
    weight.int8_activations = True
    return weight


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
    for name in TYPES:
        for n, k in SHAPES:
            packed = random_packed(name, n, k, gen)
            dense = torch.randn(n, k, generator=gen)
            cells = " | ".join(
                f"{ratio(packed, dense, torch.randn(rows, k, generator=gen), args.rounds):.2f}x"
                for rows in ROWS
            )
            print(f"| {name} | {n} x {k} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
