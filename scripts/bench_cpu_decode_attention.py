"""CPU decode attention by the KV pages' dtype: `ops().paged_decode_attention` at the default
model's shapes (9 query heads, 3 KV heads, head size 64, 16-token pages scattered over the
pool), best of rounds that alternate the page dtypes: float32 queries over every page dtype
the kernels read under them, or bfloat16 queries over bfloat16 and int8 pages. A call walks
--layers layers, each with its own pool: with the default model's 30, a batch's pages come
from memory as in serving (one layer's stay in the caches from one call to the next). With
--builds, two builds (scripts/build_cpu_kernels_as.py) are called alternately each round and
compared (old -> new ms).

    [PAGEDSERVE_CPU_ISA=LEVEL] python scripts/bench_cpu_decode_attention.py [--batch 32]
        [--query-dtype float32|bfloat16] [--layers 30] [--builds OLD.so,NEW.so]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.attention.int8_pages import to_cache
from pagedserve.cpu_kernels import import_library, ops

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
    parser.add_argument("--builds", default=None, help="OLD.so,NEW.so: compare two builds")
    args = parser.parse_args()
    builds = [import_library(p) for p in args.builds.split(",")] if args.builds else [ops()]
    page_dtypes = PAGE_DTYPES[args.query_dtype]
    print(
        f"kernel level {builds[0].kernel_level()}, batch {args.batch}, "
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
        scale = HEAD_DIM**-0.5
        for layers in caches.values():
            outputs = [
                kernels.paged_decode_attention(q, *layers[0], tables, lens, scale)
                for kernels in builds
            ]
            torch.testing.assert_close(outputs[-1], outputs[0], rtol=1e-3, atol=1e-3)
        best = {(d, i): float("inf") for d in page_dtypes for i in range(len(builds))}
        for _ in range(args.rounds):
            for dtype, layers in caches.items():
                for i, kernels in enumerate(builds):
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        for k, v in layers:
                            kernels.paged_decode_attention(q, k, v, tables, lens, scale)
                    ms = (time.perf_counter() - start) / args.calls * 1e3
                    best[dtype, i] = min(best[dtype, i], ms)
        cells = [" -> ".join(f"{best[d, i]:.3f}" for i in range(len(builds))) for d in page_dtypes]
        print(f"| {context} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
