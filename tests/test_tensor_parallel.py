"""Tensor parallelism on CPU: two real ranks on the gloo backend, one torch thread each.

Greedy token ids at TP=2 equal TP=1 on the default model (its 3 KV heads split 2 + 1) and on
tiny random Qwen2 models whose one KV head is replicated or whose two are split; one tiny run
joins through torchrun's environment (the multi-node path); the server at TP=2 answers the
OpenAI client and exits non-zero, saying why, when a worker is killed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config

from conftest import PROMPTS, assert_pool_whole
from pagedserve import LLM, SamplingParams
from pagedserve.distributed.executor import CHECK_STATE_ENV, EngineDeadError
from pagedserve.distributed.sharding import Range, ShardPlan
from pagedserve.models.gguf_file import read_config
from pagedserve.structured.spec import StructuredSpec
from test_server import ServerProcess, _free_port
from test_tiny_models import build_model

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# One torch thread per rank: the ranks share this machine's two cores.
ENGINE = dict(dtype="float32", num_threads=1)


@pytest.fixture(scope="module", autouse=True)
def _check_batch_state():
    """Every step also checks that each rank's batch state, built from the deltas alone, is
    rank 0's (a rank that differs fails, and with it the test)."""
    patch = pytest.MonkeyPatch()
    patch.setenv(CHECK_STATE_ENV, "1")
    yield
    patch.undo()


@pytest.fixture(scope="module", autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def generate(model: str | None, prompts, params: SamplingParams, tp: int, **kw) -> list[list[int]]:
    llm = LLM(model, tensor_parallel_size=tp, **ENGINE, **kw)
    try:
        out = token_ids(llm.generate(prompts, params))
        assert_pool_whole(llm.engine)
        return out
    finally:
        llm.engine.shutdown()


# ---- the plan: pure arithmetic --------------------------------------------------------------
def test_shard_plan_splits_kv_groups(default_gguf):
    cfg = read_config(default_gguf)  # SmolLM2-135M: 9 heads over 3 KV heads
    r0, r1 = ShardPlan.check(cfg, 2)
    assert (r0.kv_heads, r0.q_heads) == (Range(0, 2), Range(0, 6))
    assert (r1.kv_heads, r1.q_heads) == (Range(2, 3), Range(6, 9))
    assert r1.vocab == Range(cfg.vocab_size // 2, cfg.vocab_size)
    assert r1.checkpoint_shard("model.layers.0.self_attn.o_proj.weight").dim == 1
    assert r1.checkpoint_shard("model.norm.weight") is None


def test_shard_plan_replicates_kv_heads_and_rejects_what_cannot_split(default_gguf):
    from dataclasses import replace

    cfg = replace(read_config(default_gguf), num_heads=4, num_kv_heads=1)
    plans = ShardPlan.check(cfg, 2)
    assert [(p.kv_heads, p.q_heads) for p in plans] == [
        (Range(0, 1), Range(0, 2)),
        (Range(0, 1), Range(2, 4)),
    ]
    with pytest.raises(ValueError, match="cannot split this model's 4 attention heads"):
        ShardPlan.check(replace(cfg, num_kv_heads=2), 3)
    with pytest.raises(ValueError, match="does not divide this model's intermediate_size"):
        ShardPlan.check(replace(cfg, intermediate_size=1537), 2)
    with pytest.raises(ValueError, match="cannot split"):  # before any process starts
        LLM(tensor_parallel_size=4, **ENGINE)


def test_gguf_shards_read_alone_equal_slices_of_the_whole(default_gguf):
    """Rank 1's slices, read from the file alone (rows, or whole Q4/Q8 blocks of each row),
    equal the same slices of whole tensors, 4-bit codes and q/k head unpermuting included."""
    from pagedserve.models import gguf_file

    cfg = read_config(default_gguf)
    plan = ShardPlan.for_rank(cfg, 2, 1)
    whole = gguf_file.iter_weights(default_gguf, cfg, keep_quant=True)
    shard_of = plan.checkpoint_shard
    shards = gguf_file.iter_weights(default_gguf, cfg, keep_quant=True, shard_of=shard_of)
    seen = set()
    for (name, full), (name_s, part) in zip(whole, shards, strict=True):
        assert name == name_s
        if not name.startswith(("model.layers.0.", "model.embed_tokens")):
            break
        shard = plan.checkpoint_shard(name)
        full_parts = full.astuple() if isinstance(full, gguf_file.QuantWeight) else (full,)
        got_parts = part.astuple() if isinstance(part, gguf_file.QuantWeight) else (part,)
        assert type(full) is type(part), name
        for f, g in zip(full_parts, got_parts, strict=True):
            if shard is not None:
                # Scales and offsets hold one column per 32 of the dense matrix's.
                group = full_parts[-1].shape[-1] // f.shape[-1] if shard.dim == 1 else 1
                cut = slice(shard.start // group, shard.stop // group)
                f = f[cut] if shard.dim == 0 else f[:, cut]
            assert torch.equal(f, g), name
        seen.add(name.rsplit(".", 2)[-2])
    assert {"q_proj", "k_proj", "o_proj", "down_proj", "up_proj", "embed_tokens"} <= seen


# ---- parity with TP=1 -----------------------------------------------------------------------
def test_default_model_tp2_equals_tp1():
    expected = generate(None, PROMPTS, GREEDY, tp=1, kv_cache_memory="64MiB")
    assert generate(None, PROMPTS, GREEDY, tp=2, kv_cache_memory="64MiB") == expected


def test_structured_output_tp2_equals_tp1():
    # Grammar masks are filled and applied on rank 0 only; the ranks see plain steps.
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
        "required": ["answer", "score"],
    }
    params = SamplingParams(
        temperature=0, max_tokens=40, structured=StructuredSpec.json_schema(schema)
    )
    prompts = [f"{p} Reply in JSON." for p in PROMPTS[:4]]
    expected = generate(None, prompts, params, tp=1, kv_cache_memory="64MiB")
    assert generate(None, prompts, params, tp=2, kv_cache_memory="64MiB") == expected


@pytest.fixture(scope="module")
def tokenizer(default_gguf):
    directory, name = os.path.split(default_gguf)
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def tiny_qwen2(tokenizer, path, kv_heads: int) -> str:
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    build_model(config, tokenizer, str(path), shard=True)  # several safetensors files
    return str(path)


# Small pages and a small token budget: chunked prefill, and steps that sample nothing.
TINY = dict(kv_cache_memory="4MiB", max_num_batched_tokens=16)


def test_tiny_qwen2_one_kv_head_replicated(tokenizer, tmp_path):
    model = tiny_qwen2(tokenizer, tmp_path, kv_heads=1)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = generate(model, prompts, GREEDY, tp=1, **TINY)
    llm = LLM(model, tensor_parallel_size=2, **ENGINE, **TINY)
    try:
        assert token_ids(llm.generate(prompts, GREEDY)) == expected
        assert_pool_whole(llm.engine)
        # A worker killed while idle: noticed within a second or two, and every step after
        # that fails with the reason instead of waiting on the dead rank.
        (pid,) = llm.engine.runner.worker_pids.values()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.engine.dead_reason() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "rank 1" in llm.engine.dead_reason() and "signal 9" in llm.engine.dead_reason()
        with pytest.raises(EngineDeadError, match="rank 1 .* was killed by signal 9"):
            llm.generate(prompts[:1], GREEDY)
    finally:
        llm.engine.shutdown()


def test_tiny_qwen2_two_kv_heads_split_via_torchrun_env(tokenizer, tmp_path, monkeypatch):
    """Rank 1 started the way torchrun starts it on another host: RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT, running pagedserve.distributed.launch with the same flags."""
    model = tiny_qwen2(tokenizer, tmp_path, kv_heads=2)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = generate(model, prompts, GREEDY, tp=1, **TINY)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.distributed.launch", "generate", "-"]
        + ["--model", model, "--tensor-parallel-size", "2", "--device", "cpu"],
        env={**os.environ, **env, "RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
    )
    try:
        for key, value in {**env, "RANK": "0"}.items():
            monkeypatch.setenv(key, value)
        assert generate(model, prompts, GREEDY, tp=2, **TINY) == expected
        assert worker.wait(30) == 0  # told to stop at shutdown
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


# ---- the server -----------------------------------------------------------------------------
def test_server_tp2_answers_then_exits_when_a_worker_dies(tmp_path):
    server = ServerProcess(tmp_path / "tp.log", "--tensor-parallel-size", "2")
    try:
        server.wait_ready()
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        out = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0,
        )
        assert "Paris" in out.choices[0].text and out.usage.completion_tokens == 8
        (pid,) = re.findall(r"rank 1 pid (\d+)", server.log())
        os.kill(int(pid), signal.SIGKILL)
        start = time.monotonic()
        code = server.proc.wait(30)
        took = time.monotonic() - start
        log = server.log()
        assert code == 1, log
        assert took < 10, f"took {took:.1f} s to exit"
        assert f"tensor-parallel rank 1 (pid {pid}) was killed by signal 9" in log
        assert "the engine is dead" in log
    finally:
        server.stop()
