"""`pagedserve bench offline`: continuous batching against transformers' generate(), in process.

Both sides use the same weights (the model's GGUF or directory), the same prompts and a fixed
number of output tokens. The baseline runs one request at a time, as a naive server would.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

from pagedserve.bench.prompts import benchmark_prompts
from pagedserve.config import EngineConfig
from pagedserve.flags import dataclass_from_args
from pagedserve.llm import LLM
from pagedserve.models.loader import ModelSource, from_pretrained_args
from pagedserve.sampling_params import SamplingParams


def load_transformers_model(model: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = ModelSource.resolve(model)
    directory, kwargs = from_pretrained_args(source)
    tok = AutoTokenizer.from_pretrained(directory, **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()
    hf.generation_config.eos_token_id = None  # fixed-length outputs, like ignore_eos
    hf.generation_config.pad_token_id = 0
    return tok, hf


def run_offline_bench(args: argparse.Namespace) -> int:
    prompts = benchmark_prompts(args.num_prompts)
    cfg = dataclass_from_args(EngineConfig, args)
    llm = LLM(**dataclasses.asdict(cfg))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    ours = sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    del llm, outputs
    gc.collect()

    print(
        f"prompts: {len(prompts)} x {args.max_tokens} output tokens, "
        f"torch threads: {torch.get_num_threads()}"
    )
    print(f"pagedserve ({dtype}, continuous batching): {ours:8.1f} output tokens/s")
    n_base = min(args.baseline_prompts, len(prompts))
    if n_base == 0:
        return 0
    base = _baseline_tokens_per_s(args.model, prompts[:n_base], args.max_tokens)
    print(
        f"transformers generate() one at a time (float32, {n_base} prompts): "
        f"{base:8.1f} output tokens/s"
    )
    print(f"ratio: {ours / base:.1f}x")
    return 0


def _baseline_tokens_per_s(model: str | None, prompts: list[str], max_tokens: int) -> float:
    tok, hf = load_transformers_model(model)
    with torch.inference_mode():
        hf.generate(**tok(prompts[0], return_tensors="pt"), max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        produced = 0
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt")
            out = hf.generate(**ids, max_new_tokens=max_tokens, do_sample=False)
            produced += out.shape[1] - ids.input_ids.shape[1]
        return produced / (time.perf_counter() - start)
