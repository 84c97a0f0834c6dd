"""CPU prefill attention over the KV pages (`ops().prefill_attention_`) at the default model's
shapes (9 query heads, 3 KV heads, head size 64, 16-token pages scattered over the pool): one
layer of a prefill step of whole prompts, the engine's default dtypes for this CPU and level
(activations and KV pages), best of rounds, ms a call. With --builds, two builds
(scripts/build_cpu_kernels_as.py) are called alternately each round and compared (old -> new).

    [PAGEDSERVE_CPU_ISA=LEVEL] python scripts/bench_cpu_prefill_attention.py [--prompts 16x128]
        [--kv-cache-dtype int8] [--builds OLD.so,NEW.so]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.attention import int8_pages
from pagedserve.config import EngineConfig
from pagedserve.cpu_kernels import import_library, ops
from pagedserve.engine import _pick_dtype, _pick_kv_dtype

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="16x128,4x512", help="COUNTxTOKENS, comma-separated")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=5, help="calls timed per round")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as pagedserve serve's")
    parser.add_argument("--builds", default=None, help="OLD.so,NEW.so: compare two builds")
    args = parser.parse_args()
    cpu = torch.device("cpu")
    dtype = _pick_dtype("auto", cpu)
    kv_dtype = _pick_kv_dtype(EngineConfig(kv_cache_dtype=args.kv_cache_dtype), dtype, cpu)
    builds = [import_library(p) for p in args.builds.split(",")] if args.builds else [ops()]
    print(f"kernel level {builds[0].kernel_level()}, {dtype} queries, {kv_dtype} pages, ms a call:")
    for spec in args.prompts.split(","):
        count, tokens = map(int, spec.split("x"))
        pages = -(-tokens // PAGE_SIZE)
        tables = torch.randperm(2 * count * pages)[: count * pages].view(count, pages)
        shape = (2 * count * pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
        k, v = (int8_pages.to_cache(torch.randn(shape), kv_dtype) for _ in "kv")
        q = torch.randn(count * tokens, NUM_HEADS, HEAD_DIM).to(dtype)
        outs = [torch.empty_like(q) for _ in builds]
        starts, lens = [i * tokens for i in range(count)], [tokens] * count
        contexts = torch.full((count,), tokens)
        call = (starts, lens, contexts, tables, HEAD_DIM**-0.5)
        best = [float("inf")] * len(builds)
        for _ in range(args.rounds):
            for i, kernels in enumerate(builds):
                start = time.perf_counter()
                for _ in range(args.calls):
                    kernels.prefill_attention_(q, k, v, outs[i], *call)
                best[i] = min(best[i], (time.perf_counter() - start) / args.calls)
        torch.testing.assert_close(outs[-1], outs[0], rtol=1e-3, atol=1e-3)
        ms = " -> ".join(f"{b * 1e3:.3f}" for b in best)
        print(f"| {count} x {tokens} tokens | {ms} |")


if __name__ == "__main__":
    main()
