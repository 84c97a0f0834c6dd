"""Greedy parity with transformers on tiny random models of each supported architecture."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from conftest import PROMPTS, assert_pool_whole, hf_greedy
from pagedserve import LLM, SamplingParams
from pagedserve.models.config import UnsupportedModelError

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
)

CONFIGS = {
    "llama-gqa-llama3-rope": LlamaConfig(
        **COMMON,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
    ),
    "mistral": MistralConfig(**COMMON, num_key_value_heads=1, sliding_window=None),
    "qwen2-bias": Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def tokenizer(default_gguf):
    directory, name = os.path.split(default_gguf)
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def build_model(config, tokenizer, path: str, shard: bool) -> AutoModelForCausalLM:
    config.vocab_size = len(tokenizer)
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Wider weights than the default init so that greedy choices are not near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(path, max_shard_size="1MB" if shard else "1GB")
    tokenizer.save_pretrained(path)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_parity(name, tokenizer, tmp_path):
    shard = name == "qwen2-bias"
    ref = build_model(CONFIGS[name], tokenizer, str(tmp_path), shard)
    if shard:
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    outputs = llm.generate(prompts, params)
    expected = [hf_greedy(ref, p, 16) for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_pool_whole(llm.engine)


def test_unknown_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*not supported"):
        LLM(str(tmp_path))


def test_not_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(UnsupportedModelError, match="neither"):
        LLM(str(tmp_path / "missing.bin"))
