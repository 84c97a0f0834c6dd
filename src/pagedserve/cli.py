"""`pagedserve` command line: generate, serve, bench. Flags come from the config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from pagedserve.flags import add_dataclass_flags, dataclass_from_args

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.engine import LLMEngine


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.config import EngineConfig
    from pagedserve.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    cfg = dataclass_from_args(EngineConfig, args)
    llm = LLM(**dataclasses.asdict(cfg))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed
    )
    out = llm.chat([{"role": "user", "content": args.prompt}], params) if args.chat else None
    out = out or llm.generate([args.prompt], params)
    print(out[0].outputs[0].text)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.config import EngineConfig
    from pagedserve.ray_serve.config import DataParallelConfig, require_ray
    from pagedserve.server.config import ServerConfig

    engine = dataclass_from_args(EngineConfig, args)
    server = dataclass_from_args(ServerConfig, args)
    dp = dataclass_from_args(DataParallelConfig, args)
    if dp.data_parallel_size > 1:
        require_ray()
        from pagedserve.ray_serve.launch import run_data_parallel

        return run_data_parallel(engine, server, dp)
    load_engine = _load_in_background(engine)
    from pagedserve.server.api_server import run_server  # FastAPI: ~0.7 s of imports

    return run_server(load_engine, server)


def _load_in_background(config: EngineConfig) -> Callable[[], LLMEngine]:
    """Start building the engine now, in a thread, so that the server's imports and start
    overlap it (its weights' packing runs in C++ without the GIL); the callable waits for the
    engine, or raises what stopped it."""
    from pagedserve.engine import LLMEngine
    from pagedserve.models.loader import use_one_malloc_arena

    done: Future[LLMEngine] = Future()

    def load() -> None:
        try:
            done.set_result(LLMEngine(config))
        except BaseException as e:  # noqa: BLE001 - re-raised by the waiting caller
            done.set_exception(e)

    use_one_malloc_arena()
    threading.Thread(target=load, name="pagedserve-load", daemon=True).start()
    return done.result


def _cmd_bench_offline(args: argparse.Namespace) -> int:
    from pagedserve.bench.offline import run_offline_bench

    return run_offline_bench(args)


def _cmd_bench_kv(args: argparse.Namespace) -> int:
    from pagedserve.bench import kv

    return kv.run_prefix_bench(args) if args.kind == "prefix" else kv.run_capacity_bench(args)


def _cmd_bench_step(args: argparse.Namespace) -> int:
    from pagedserve.bench.step_profile import run_step_profile

    return run_step_profile(args)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from pagedserve.bench.serve import run_serve_bench

    return run_serve_bench(args)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    from pagedserve.config import EngineConfig
    from pagedserve.ray_serve.config import DataParallelConfig
    from pagedserve.server.config import ServerConfig

    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="Print a completion of a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="Seed of this request")
    gen.add_argument("--chat", action="store_true", help="Wrap the prompt in the chat template")
    add_dataclass_flags(gen, EngineConfig)
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="Serve the OpenAI-compatible HTTP API")
    add_dataclass_flags(serve, EngineConfig)
    add_dataclass_flags(serve, ServerConfig)
    add_dataclass_flags(serve, DataParallelConfig)
    serve.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="Benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = bench_sub.add_parser(
        "offline", help="Continuous batching against transformers generate(), in process"
    )
    offline.add_argument("--num-prompts", type=int, default=64)
    offline.add_argument("--max-tokens", type=int, default=128)
    offline.add_argument(
        "--baseline-prompts",
        type=int,
        default=8,
        help="Prompts timed for the baseline (0: skip it)",
    )
    add_dataclass_flags(offline, EngineConfig)
    offline.set_defaults(func=_cmd_bench_offline)

    prefix = bench_sub.add_parser("prefix", help="Shared system prompt, prefix caching on vs off")
    prefix.add_argument("--num-prompts", type=int, default=32)
    prefix.add_argument("--prefix-tokens", type=int, default=1000)
    prefix.add_argument("--max-tokens", type=int, default=16)
    prefix.add_argument("--kv-cache-memory", default="512MiB")
    prefix.add_argument("--model", default=None)
    prefix.add_argument("--dtype", default="auto")
    prefix.set_defaults(func=_cmd_bench_kv, kind="prefix")

    capacity = bench_sub.add_parser("capacity", help="Sequences held at one KV budget")
    capacity.add_argument("--num-prompts", type=int, default=64)
    capacity.add_argument("--max-tokens", type=int, default=128)
    capacity.add_argument("--kv-cache-memory", default="256MiB")
    capacity.add_argument("--max-model-len", type=int, default=2048)
    capacity.add_argument("--model", default=None)
    capacity.add_argument("--dtype", default="auto")
    capacity.set_defaults(func=_cmd_bench_kv, kind="capacity")

    step = bench_sub.add_parser(
        "step", help="Decode step time: model forward vs the rest, GFLOP/s vs matmul peak"
    )
    step.add_argument("--batch-sizes", type=_int_list, default=[1, 32], help="(default: 1,32)")
    step.add_argument("--prompt-len", type=int, default=128, help="Tokens per prompt")
    step.add_argument("--steps", type=int, default=32, help="Decode steps timed per batch size")
    step.add_argument(
        "--output-len",
        type=int,
        default=0,
        help="Tokens each request has already generated when the timed steps start",
    )
    add_dataclass_flags(step, EngineConfig)
    step.set_defaults(func=_cmd_bench_step)

    srv = bench_sub.add_parser(
        "serve", help="Load generator against a running OpenAI-compatible /v1/completions"
    )
    srv.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    srv.add_argument("--model", default=None, help="Model id (default: first of /v1/models)")
    srv.add_argument("--concurrency", type=_int_list, default=[1, 8, 32], help="(default: 1,8,32)")
    srv.add_argument("--num-prompts", type=int, default=64, help="Requests per level")
    srv.add_argument("--max-tokens", type=int, default=128, help="Output tokens per request")
    srv.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="inf: closed loop; R: Poisson arrivals at R/s, concurrency caps those in flight",
    )
    srv.add_argument(
        "--dataset",
        default=None,
        help='JSON lines of {"prompt": ...} (default: the prompt set shipped in pagedserve/bench)',
    )
    srv.add_argument(
        "--synthetic-input-len", type=int, default=None, help="Random prompts of L tokens"
    )
    srv.add_argument("--tokenizer", default=None, help="For synthetic prompts (default model's)")
    srv.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    srv.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    srv.add_argument(
        "--min-tokens",
        action="store_true",
        help="Also send min_tokens = max tokens, for servers that ignore ignore_eos (llama.cpp's)",
    )
    srv.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    srv.add_argument(
        "--unique-prompts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Start each prompt with a marker unique to the run, level and request, so that "
        "prefix caches cannot reuse prompts repeated across levels",
    )
    srv.add_argument(
        "--shared-prefixes",
        type=int,
        default=0,
        metavar="K",
        help="Shared-prefix workload: K synthetic system prompts, request i continuing prompt "
        "i mod K (interleaved); reports the server's prefix-cache hit rate (default 0: off)",
    )
    srv.add_argument(
        "--prefix-len", type=int, default=512, help="Tokens of each shared system prompt"
    )
    srv.add_argument(
        "--structured",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Constrain each request to a JSON schema of its own (structured_outputs.json)",
    )
    srv.add_argument("--seed", type=int, default=0, help="Prompt order and arrival times")
    srv.add_argument("--timeout", type=float, default=3600.0, help="Read timeout per request (s)")
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--json", default=None, metavar="FILE", help="Write every figure as JSON")
    srv.add_argument("--plot", default=None, metavar="FILE.png", help="Plot against concurrency")
    srv.set_defaults(func=_cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad flags or an unsupported model: one clear line, no traceback
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
