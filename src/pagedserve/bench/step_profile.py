"""`pagedserve bench step`: where a decode step's time goes, against the machine's matmul peak.

For each batch size it fills the engine with that many requests (each with `--output-len`
tokens already generated, prefilled with its prompt), lets them prefill, then times decode
steps: the whole `engine.step()`, the model forward inside it (embedding to logits), and the
rest (scheduling, batch tensors, sampling, detokenizing). The forward's
achieved GFLOP/s counts the matrix products (2 x weights x tokens) and attention's two products
over the context; the peak is a plain torch matmul of the same dtype, measured here too.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from pagedserve import detokenizer
from pagedserve.config import EngineConfig
from pagedserve.engine import LLMEngine
from pagedserve.flags import dataclass_from_args
from pagedserve.models.config import ModelConfig
from pagedserve.sampling_params import SamplingParams


@dataclasses.dataclass
class StepProfile:
    batch: int
    context: int  # mean tokens per sequence over the timed steps
    step_ms: float  # median engine.step()
    forward_ms: float  # median model forward + logits within it
    gflop: float  # per step

    @property
    def outside_share(self) -> float:
        return 1 - self.forward_ms / self.step_ms

    @property
    def forward_gflops(self) -> float:
        return self.gflop / (self.forward_ms / 1e3)


def matmul_peak_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """The best of five timings of `repeats` products (the first runs also warm the CPU's
    matrix units up)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 * repeats / best / 1e9


def decode_gflop(cfg: ModelConfig, batch: int, context: int) -> float:
    """Floating-point work of one decode step of `batch` sequences at `context` tokens."""
    h, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (h + 2 * kv) + h * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    weights = cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size  # + lm_head
    attention = cfg.num_layers * 2 * context * h  # q.k and p.v per query head
    return 2 * batch * (weights + attention) / 1e9


class _ForwardTimer:
    """Wraps the runner's model so that every forward + logits call is timed."""

    def __init__(self, runner) -> None:
        self.runner, self.model = runner, runner.model
        self.last_ms = 0.0

    def __enter__(self) -> _ForwardTimer:
        timer, model = self, self.model

        class Timed(torch.nn.Module):
            def forward(self, *args):
                timer._start = time.perf_counter()
                return model(*args)

            def compute_logits(self, hidden):
                logits = model.compute_logits(hidden)
                timer.last_ms = (time.perf_counter() - timer._start) * 1e3
                return logits

        self.runner.model = Timed()
        return self

    def __exit__(self, *exc) -> None:
        self.runner.model = self.model


def profile_batch(
    engine: LLMEngine, batch: int, prompt_len: int, steps: int, output_len: int = 0
) -> StepProfile:
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_len + steps + 8, ignore_eos=True)
    ids = [[(7 * r + i) % (vocab - 1) + 1 for i in range(prompt_len)] for r in range(batch)]
    for r, prompt in enumerate(ids):
        state = engine.add_request(f"profile-{batch}-{r}", prompt, params)
        for seq in state.seqs:  # as if generated: computed with the prompt, like a preemption's
            seq.output_token_ids = [(5 * r + i) % (vocab - 1) + 1 for i in range(output_len)]
            detokenizer.start(seq)
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # prefill
    step_ms, fwd_ms, contexts = [], [], []
    with _ForwardTimer(engine.runner) as timer:
        for _ in range(steps):
            contexts.append(statistics.mean(s.num_tokens for s in engine.scheduler.running))
            start = time.perf_counter()
            engine.step()
            step_ms.append((time.perf_counter() - start) * 1e3)
            fwd_ms.append(timer.last_ms)
    for r in range(batch):
        engine.abort_request(f"profile-{batch}-{r}")
    context = round(statistics.mean(contexts))
    return StepProfile(
        batch,
        context,
        statistics.median(step_ms),
        statistics.median(fwd_ms),
        decode_gflop(engine.model_config, batch, context),
    )


def run_step_profile(args: argparse.Namespace) -> int:
    cfg = dataclass_from_args(EngineConfig, args)
    if cfg.tensor_parallel_size > 1:
        raise ValueError("bench step times one process: use --tensor-parallel-size 1")
    engine = LLMEngine(cfg)
    dtype = engine.dtype
    peak = matmul_peak_gflops(dtype)
    name = str(dtype).removeprefix("torch.")
    print(f"torch threads: {torch.get_num_threads()}, dtype {name}")
    print(f"matmul peak ({name}, 2048^3, plain torch): {peak:.1f} GFLOP/s")
    profile_batch(engine, 2, args.prompt_len, 4)  # warm-up
    print(
        "| batch | context | step ms | forward ms | outside forward | forward GFLOP/s | of peak |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        p = profile_batch(engine, batch, args.prompt_len, args.steps, args.output_len)
        print(
            f"| {p.batch} | {p.context} | {p.step_ms:.1f} | {p.forward_ms:.1f} | "
            f"{p.outside_share:.0%} | {p.forward_gflops:.1f} | {p.forward_gflops / peak:.0%} |"
        )
    engine.shutdown()
    return 0
