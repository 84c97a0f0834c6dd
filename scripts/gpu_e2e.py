"""End-to-end GPU throughput on a model built from a config (random weights are fine for speed).

Writes a Llama-3-8B-shaped checkpoint (bf16 random weights, a word-level tokenizer) to a
directory, then measures with pagedserve on CUDA:
- output tokens/s of a batch of 256 requests, with CUDA graphs on and, if the engine has the
  `enforce_eager` knob, off;
- the batch-1 decode step time against the pure weight-reading time (model bytes / peak
  bandwidth).

    python scripts/gpu_e2e.py --workdir /tmp/llama3-8b-random [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
)


def build_checkpoint(path: str, layers: int) -> int:
    """Random bf16 weights, one safetensors shard per layer; returns the model's bytes."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    c = dict(LLAMA3_8B, num_hidden_layers=layers)
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    config = dict(
        c,
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        head_dim=d,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)

    def rand(*shape: int) -> torch.Tensor:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return (torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02).cpu()

    weight_map: dict[str, str] = {}
    total = 0

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        nonlocal total
        save_file(tensors, os.path.join(path, name))
        weight_map.update({k: name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    save(
        {
            "model.embed_tokens.weight": rand(v, h),
            "lm_head.weight": rand(v, h),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        },
        "embed.safetensors",
    )
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes = {
            "self_attn.q_proj.weight": (h, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, h),
            "mlp.gate_proj.weight": (i, h),
            "mlp.up_proj.weight": (i, h),
            "mlp.down_proj.weight": (h, i),
        }
        tensors = {p + k: rand(*s) for k, s in shapes.items()}
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        save(tensors, f"layer{layer:03d}.safetensors")
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)

    # Prompts are token ids; the tokenizer only has to load (and decode something).
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{n}": n for n in range(3, 1000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path)
    return total


def run(
    path: str, eager: bool | None, num_requests: int, prompt_len: int, out_len: int
) -> tuple[str, float] | None:
    """Throughput and batch-1 step time of one engine setup; (label, step ms) or None."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.config import EngineConfig

    kwargs = dict(device="cuda", dtype="bfloat16", attention_backend="triton")
    label = "default"
    if eager is not None:
        if "enforce_eager" not in EngineConfig.field_names():
            print(f"  CUDA graphs {'off' if eager else 'on'}: skipped, no enforce_eager knob yet")
            return None
        kwargs["enforce_eager"] = eager
        label = "CUDA graphs off" if eager else "CUDA graphs on"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (prompt_len,), generator=gen).tolist() for _ in range(256)]
    try:
        llm = LLM(path, **kwargs)
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts[:num_requests], params)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"  {label}: {num_requests} requests x {out_len}: {tokens / elapsed:8.0f} tok/s")

        one = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts[:1], one)
        per_step = (time.perf_counter() - start) / out_len  # includes the one prefill step
        print(f"  {label}: batch-1 decode step {per_step * 1e3:.2f} ms")
        del llm
        return label, per_step * 1e3
    except Exception:
        print(f"  {label}: FAILED")
        traceback.print_exc(limit=4)
        return None
    finally:
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/pagedserve-llama3-8b-random")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_e2e.py needs a CUDA GPU")

    from bench_decode_attention import measured_copy_bandwidth, nominal_peak

    start = time.perf_counter()
    model_bytes = build_checkpoint(args.workdir, args.layers)
    print(
        f"checkpoint: Llama-3-8B shapes, {args.layers} layers, {model_bytes / 1e9:.1f} GB bf16, "
        f"written in {time.perf_counter() - start:.0f}s"
    )
    name = torch.cuda.get_device_name()
    peak = nominal_peak(name) or measured_copy_bandwidth(torch.device("cuda"))
    weight_ms = model_bytes / peak * 1e3
    print(f"weight-reading time at {peak / 1e12:.2f} TB/s: {weight_ms:.2f} ms per step")
    shape = (args.num_requests, args.prompt_len, args.max_tokens)
    results = [run(args.workdir, eager, *shape) for eager in (False, True)]
    if results == [None, None] and "enforce_eager" not in _knobs():
        results = [run(args.workdir, None, *shape)]
    for label, ms in filter(None, results):
        print(f"  {label}: batch-1 step / weight-reading time = {ms / weight_ms:.2f} (goal <= 1.5)")
    return 0


def _knobs() -> list[str]:
    from pagedserve.config import EngineConfig

    return EngineConfig.field_names()


if __name__ == "__main__":
    raise SystemExit(main())
