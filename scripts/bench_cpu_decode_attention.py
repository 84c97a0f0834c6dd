"""CPU decode attention by the KV pages' dtype: `ops().paged_decode_attention` at the default
model's shapes (9 query heads, 3 KV heads, head size 64, 16-token pages scattered over the
pool), best of rounds that alternate the page dtypes: float32 queries over every page dtype
the kernels read under them, or bfloat16 queries over bfloat16 and int8 pages. A call walks
--layers layers, each with its own pool: with the default model's 30, a batch's pages come
from memory as in serving (one layer's stay in the caches from one call to the next).

    [PAGEDSERVE_CPU_ISA=LEVEL] python scripts/bench_cpu_decode_attention.py [--batch 32]
        [--query-dtype float32|bfloat16] [--layers 30]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.attention.int8_pages import to_cache
from pagedserve.cpu_kernels import ops

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16
PAGE_DTYPES = {
    "float32": [torch.float32, torch.float16, torch.bfloat16, torch.int8],
    "bfloat16": [torch.bfloat16, torch.int8],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", default="145,400", help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=30, help="calls timed per round")
    parser.add_argument("--layers", type=int, default=1, help="layers a call, a pool each")
    parser.add_argument("--query-dtype", choices=sorted(PAGE_DTYPES), default="float32")
    args = parser.parse_args()
    kernels = ops()
    page_dtypes = PAGE_DTYPES[args.query_dtype]
    print(
        f"kernel level {kernels.kernel_level()}, batch {args.batch}, "
        f"{args.query_dtype} queries, {args.layers} layer(s), ms per call:"
    )
    print(
        "| context | " + " | ".join(f"{d} pages".removeprefix("torch.") for d in page_dtypes) + " |"
    )
    print("|---:|" + "---:|" * len(page_dtypes))
    for context in map(int, args.contexts.split(",")):
        pages = -(-context // PAGE_SIZE)
        pool = 2 * args.batch * pages
        tables = torch.randperm(pool)[: args.batch * pages].view(args.batch, pages)
        lens = torch.full((args.batch,), context)
        q = torch.randn(args.batch, NUM_HEADS, HEAD_DIM).to(getattr(torch, args.query_dtype))
        shape = (pool, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
        caches = {
            d: [
                (to_cache(torch.randn(shape), d), to_cache(torch.randn(shape), d))
                for _ in range(args.layers)
            ]
            for d in page_dtypes
        }
        best = dict.fromkeys(page_dtypes, float("inf"))
        for _ in range(args.rounds):
            for dtype, layers in caches.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    for k, v in layers:
                        kernels.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5)
                ms = (time.perf_counter() - start) / args.calls * 1e3
                best[dtype] = min(best[dtype], ms)
        print(f"| {context} | " + " | ".join(f"{best[d]:.3f}" for d in page_dtypes) + " |")


if __name__ == "__main__":
    main()
