"""Fused C++ kernels for CPU steps, one build per kernel level (cpu_kernels/isa.py), compiled
on first use and cached.

torch's extension builder compiles the sources with the level's -m flags into
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR) once; later processes load the cached
library in well under a second. `make install` builds this machine's level ahead of the first
server start. Each source holds every level's code behind the compiler's feature macros
(__AMX_TILE__, __AVX512F__, __AVX2__), so one set of files serves all levels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

from pagedserve.cpu_kernels.isa import compile_flags, kernel_level, target_tag

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(f)
    for f in ("cpu_ops.cpp", "quant_linear.cpp", "prefill_attention.cpp")
]
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# -fopenmp: at::parallel_for runs on torch's OpenMP pool (serially without it).
BASE_CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]


def build_name(level: str, headers: list[Path] = HEADERS) -> str:
    """The extension's name: its level and target CPU (isa.target_tag), and a digest of the
    headers, since torch's builder rebuilds a cached extension when a listed source changes,
    not when only a header they include does."""
    digest = hashlib.sha256()
    for header in headers:
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return f"pagedserve_cpu_ops_{target_tag(level)}_{digest.hexdigest()[:12]}"


@functools.cache
def ops_for(level: str) -> ModuleType:
    """The kernels built for `level` (which this CPU must support)."""
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # torch's builder runs `ninja` from PATH
        import ninja  # the pip package's binary, for a venv that is not activated

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    start = time.monotonic()
    module = load(
        name=build_name(level),
        sources=[str(p) for p in SOURCES],
        extra_cflags=[*BASE_CFLAGS, *compile_flags(level)],
        extra_ldflags=["-fopenmp", "-lm"],
        verbose=False,
    )
    if module.kernel_level() != level:
        raise RuntimeError(f"the {level} build reports level {module.kernel_level()}")
    if (elapsed := time.monotonic() - start) > 2:
        logger.info("built the %s CPU kernels in %.0f s (cached for later starts)", level, elapsed)
    return module


def ops() -> ModuleType:
    """The kernels of this process's level."""
    return ops_for(kernel_level())
