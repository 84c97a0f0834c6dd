"""Decode-attention microbenchmark: achieved memory bandwidth of the Triton paged kernel.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head dim 128, bf16, 16-token pages),
pages scattered at random over the pool. Bytes moved = K and V of every context (read once
per KV head, GQA-aware) + queries + outputs; bandwidth = bytes / kernel time, set against the
GPU's peak (a table of nominal HBM figures) and a measured device-to-device copy.

    python scripts/bench_decode_attention.py            # on a GPU
    TRITON_INTERPRET=1 python scripts/bench_decode_attention.py --smoke   # CPU: does it run
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.attention import triton_kernels as tk

# Nominal HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name().
PEAK_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.04e12,
    "A100": 1.56e12,
    "L40S": 0.864e12,
    "A10": 0.6e12,
}

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
CASES = [(1, 32768), (1, 8192), (8, 8192), (32, 4096), (128, 2048), (256, 1024)]
SMOKE_CASES = [(2, 70)]


def nominal_peak(name: str) -> float | None:
    for key, value in PEAK_BANDWIDTH.items():
        if key in name:
            return value
    return None


def time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measured_copy_bandwidth(device: torch.device) -> float:
    """Read + write bytes per second of a 1 GiB device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (ms * 1e-3)


def run_case(batch: int, ctx: int, device: torch.device, dtype: torch.dtype, num_splits: int):
    pages_per_seq = -(-ctx // PAGE_SIZE)
    num_pages = batch * pages_per_seq
    shape = (num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.randperm(num_pages, device=device).view(batch, pages_per_seq)
    context_lens = torch.full((batch,), ctx, dtype=torch.long, device=device)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    out = torch.empty_like(q)

    def fn():
        tk.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            tables,
            context_lens,
            HEAD_DIM**-0.5,
            ctx,
            num_splits=num_splits,
            out=out,
        )

    ms = time_ms(fn, device)
    elem = k_cache.element_size()
    moved = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * elem + 2 * q.numel() * elem
    return ms, moved / (ms * 1e-3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, just check it runs")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not tk.interpreting():
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1 and --smoke")
    dtype = torch.bfloat16
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        peak = nominal_peak(name)
        copy_bw = measured_copy_bandwidth(device)
        peak_text = f"{peak / 1e12:.2f} TB/s nominal" if peak else "nominal peak unknown"
        print(f"device: {name}, {sms} SMs, {peak_text}, copy {copy_bw / 1e12:.2f} TB/s measured")
    else:
        sms, peak, copy_bw = 1, None, None
    print("batch  context  splits   time_us   GB/s  %peak  %copy")
    for batch, ctx in SMOKE_CASES if args.smoke else CASES:
        auto = tk.choose_num_splits(batch, NUM_KV_HEADS, ctx, sms)
        for splits in sorted({1, auto}):
            ms, bw = run_case(batch, ctx, device, dtype, splits)
            pct = f"{100 * bw / peak:5.1f}" if peak else "    -"
            pct_copy = f"{100 * bw / copy_bw:5.1f}" if copy_bw else "    -"
            row = f"{batch:5d} {ctx:8d} {splits:7d} {ms * 1e3:9.1f} {bw / 1e9:6.0f}"
            print(f"{row}  {pct}  {pct_copy}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
