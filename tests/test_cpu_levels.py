"""The default model at each CPU kernel level this machine runs (a process per level, capped by
PAGEDSERVE_CPU_ISA as a user would): float32 greedy output equal to transformers', and the
level's fast default (dtype auto, packed weights) close to float32 in vLLM's sense: at the
first token where the two differ, each side's token is among the other's top-5 logprobs. The
same holds for float32 over int8 KV pages against float32 over float32 ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import PROMPTS, TOP, agreeing_prefix, hf_greedy
from pagedserve.cpu_kernels import isa

MAX_TOKENS = 32


def run_level(level: str) -> dict:
    env = {**os.environ, isa.CAP_ENV: level}
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(PROMPTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def expected(hf_reference):
    from transformers import AutoTokenizer

    from pagedserve.models.loader import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return [hf_greedy(hf_reference, tok.encode(p), MAX_TOKENS) for p in PROMPTS]


@pytest.mark.timeout(1200)  # a level's first use compiles its kernels (~1 minute when idle)
@pytest.mark.parametrize("level", isa.levels_supported())
def test_default_model_at_each_level(level, expected):
    result = run_level(level)
    assert result["level"] == level
    assert [r["ids"] for r in result["float32"]] == expected
    agree = [agreeing_prefix(f, r) for f, r in zip(result["fast"], result["float32"], strict=True)]
    # float32 logits (Linear.float_out): bfloat16 ones rounded near-equal logits into ties, whose
    # lower token id greedy took (the chat "What is the capital of France?" began "L'Étoile")
    tied = [lp for r in result["fast"] for lp in r["logprobs"] if len(set(lp.values())) < len(lp)]
    assert not tied, f"tied top-{TOP} logprobs: {tied[:3]}"
    # float32 activations keep 16-bit KV pages (bfloat16 in the portable kernels), bfloat16
    # ones their own dtype
    pages = {"float32": "bfloat16" if level == "generic" else "float16"}
    assert result["fast_kv_dtype"] == pages.get(d := result["fast_dtype"], d)
    int8 = [
        agreeing_prefix(f, r) for f, r in zip(result["int8_kv"], result["float32"], strict=True)
    ]
    print(
        f"{level} ({result['fast_dtype']}, {result['fast_kv_dtype']} KV): tokens agreeing with"
        f" float32 per prompt: {agree}; float32 over int8 KV pages: {int8}"
    )


def main() -> None:
    """One level's outputs (the level comes from $PAGEDSERVE_CPU_ISA), as JSON on stdout."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.cpu_kernels import ops

    prompts = json.loads(sys.argv[1])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)

    def run(llm: LLM) -> list[dict]:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [{"ids": o.token_ids, "logprobs": o.logprobs} for o in outs]

    exact = run(LLM(dtype="float32", quantization="none", kv_cache_memory="64MiB"))
    fast_llm = LLM(kv_cache_memory="64MiB")
    result = {
        "level": ops().kernel_level(),
        "float32": exact,
        "fast": run(fast_llm),
        # int8 pages alone: the same float32 model over int8 KV pages
        "int8_kv": run(
            LLM(
                dtype="float32", quantization="none", kv_cache_dtype="int8", kv_cache_memory="64MiB"
            )
        ),
        "fast_dtype": str(fast_llm.engine.dtype).removeprefix("torch."),
        "fast_kv_dtype": str(fast_llm.engine.kv_dtype).removeprefix("torch."),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
