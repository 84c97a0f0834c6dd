"""CPU decode attention by the KV pages' dtype: `ops().paged_decode_attention` at the default
model's shapes (9 query heads, 3 KV heads, head size 64, 16-token pages scattered over the
pool), float32 queries, one layer, best of rounds that alternate the page dtypes.

    [PAGEDSERVE_CPU_ISA=LEVEL] python scripts/bench_cpu_decode_attention.py [--batch 32]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.cpu_kernels import ops

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16
PAGE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", default="145,400", help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=30, help="calls timed per round")
    args = parser.parse_args()
    kernels = ops()
    print(f"kernel level {kernels.kernel_level()}, batch {args.batch}, ms per call:")
    print(
        "| context | " + " | ".join(f"{d} pages".removeprefix("torch.") for d in PAGE_DTYPES) + " |"
    )
    print("|---:|" + "---:|" * len(PAGE_DTYPES))
    for context in map(int, args.contexts.split(",")):
        pages = -(-context // PAGE_SIZE)
        pool = 2 * args.batch * pages
        tables = torch.randperm(pool)[: args.batch * pages].view(args.batch, pages)
        lens = torch.full((args.batch,), context)
        q = torch.randn(args.batch, NUM_HEADS, HEAD_DIM)
        shape = (pool, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
        caches = {d: (torch.randn(shape).to(d), torch.randn(shape).to(d)) for d in PAGE_DTYPES}
        best = dict.fromkeys(PAGE_DTYPES, float("inf"))
        for _ in range(args.rounds):
            for dtype, (k, v) in caches.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    kernels.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5)
                ms = (time.perf_counter() - start) / args.calls * 1e3
                best[dtype] = min(best[dtype], ms)
        print(f"| {context} | " + " | ".join(f"{best[d]:.3f}" for d in PAGE_DTYPES) + " |")


if __name__ == "__main__":
    main()
