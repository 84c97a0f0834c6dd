"""The serving benchmark's workload in process, no server: `bench serve`'s prompts, 128 output
tokens each, a closed loop of C requests in flight; output tokens/s and the time in steps that
prefill against steps that only decode. Without HTTP and the client on the same two cores, a
before/after of a kernel shows here with less noise (run the builds alternately).

    [PAGEDSERVE_CPU_ISA=LEVEL] python scripts/bench_cpu_closed_loop.py [--concurrency 32]
"""

from __future__ import annotations

import argparse
import collections
import time

from pagedserve.bench.serve_prompts import load_dataset
from pagedserve.config import EngineConfig
from pagedserve.cpu_kernels import isa
from pagedserve.engine import LLMEngine
from pagedserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig())
    prompts = load_dataset(None)
    ids = [engine.tokenize_prompt(prompts[i % len(prompts)])[1] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.add_request("warm-up", ids[0][:16], SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    seconds, steps, prompt_tokens = collections.Counter(), collections.Counter(), 0
    added = done = 0
    start = time.perf_counter()
    while done < args.num_prompts:
        while added - done < args.concurrency and added < args.num_prompts:
            engine.add_request(f"r{added}", ids[added], params)
            added += 1
        before = engine.counters.prompt_tokens
        t = time.perf_counter()
        deltas = engine.step()
        kind = "prefill" if engine.counters.prompt_tokens > before else "decode"
        seconds[kind] += time.perf_counter() - t
        steps[kind] += 1
        prompt_tokens += engine.counters.prompt_tokens - before
        done += sum(d.finished for d in deltas)
    total = time.perf_counter() - start
    out = args.num_prompts * args.max_tokens
    print(f"kernel level {isa.kernel_level()}, concurrency {args.concurrency}: ", end="")
    print(f"{out / total:.1f} output tok/s ({total:.1f} s, {prompt_tokens} prompt tokens)")
    for kind in ("prefill", "decode"):
        if steps[kind]:
            ms = seconds[kind] / steps[kind] * 1e3
            print(f"  steps that {kind}: {steps[kind]}, {seconds[kind]:.1f} s, {ms:.1f} ms a step")
    engine.shutdown()


if __name__ == "__main__":
    main()
