"""Shared fixtures: the default model (real weights) and tiny random models built on the fly."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve import cpu_kernels
from pagedserve.cpu_kernels import isa
from pagedserve.models.loader import default_model_path

# Two cores: keep torch from oversubscribing when tests run beside a server subprocess.
torch.set_num_threads(2)

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Explain photosynthesis in simple terms.",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Write a haiku about the sea:",
    "In 1492, Columbus",
]


@pytest.fixture(params=isa.levels_supported())
def kernel_level(request, monkeypatch) -> str:
    """Each CPU kernel level this machine runs, as the level of ops() (and so of every layer op
    and attention call) for one test."""
    monkeypatch.setattr(cpu_kernels, "kernel_level", lambda: request.param)
    return request.param


@pytest.fixture(scope="session")
def default_gguf() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_reference(default_gguf):
    """transformers' own load of the same GGUF, fp32, EOS disabled for fixed-length greedy runs."""
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(default_gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


TOP = 5  # logprobs compared where outputs may differ


def agreeing_prefix(fast: dict, ref: dict) -> int:
    """Tokens equal before the first difference of two greedy runs ({"ids", "logprobs"} each),
    where each side's token must be among the other's top-5 (vLLM's check_logprobs_close).
    Logprob keys are token ids, or their strings after a JSON round trip."""
    for i, (a, b) in enumerate(zip(fast["ids"], ref["ids"], strict=True)):
        if a != b:
            assert a in map(int, ref["logprobs"][i]), f"token {a} not in the reference's top-{TOP}"
            assert b in map(int, fast["logprobs"][i]), f"reference token {b} not in the top-{TOP}"
            return i
    return len(fast["ids"])


def assert_int8_products(got, x, dense, bias, reference, slack) -> None:
    """A packed linear's result `got` (x @ dense^T + bias, int8_activations set) against
    llama.cpp's integer products `reference` = (result without bias, rounding bound), and
    visibly not float32 products (x's largest activation 64x the others); where `reference` is
    None (no integer products there), against float32 products within `slack(x, dense, exact)`."""
    exact = torch.nn.functional.linear(x.float(), dense, bias.float())
    if reference is None:
        assert ((got - exact).abs() <= slack(x, dense, exact)).all()
        return
    want, bound = reference
    want = want + bias.float()
    if x.dtype == torch.bfloat16:
        bound = bound + 2**-8 * want.abs()  # the result rounded to bf16
    assert ((got - want).abs() <= bound).all()
    if x.dtype == torch.float32:  # not float32 products (bf16's own rounding would hide it)
        assert (got - exact).abs().max() > 10 * slack(x, dense, exact).max()


def amx_tiles(level: str, rows: int, int8: bool) -> bool:
    """Whether a packed linear (block or K type) multiplies bf16 rows with AMX tiles: over 4
    rows, and over 8 with int8_activations."""
    return level == "amx" and rows > (8 if int8 else 4)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids) :].tolist()


def assert_pool_whole(engine) -> None:
    """Every page is free or held only by the prefix cache; nothing is left running."""
    bm = engine.block_manager
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert bm.num_free_pages == bm.num_pages, f"{bm.num_used_pages} pages leaked"
    assert all(p.ref_count == 0 for p in bm.pages)
    assert engine.reset_prefix_cache()
    assert bm.num_cached_pages == 0
