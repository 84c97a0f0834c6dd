"""Fused C++ kernels for CPU steps (cpu_ops.cpp, quant_linear.cpp, prefill_attention.cpp),
compiled on first use and cached.

torch's extension builder compiles them for this machine's CPU (-march=native) into
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR) once; later processes load the cached
library in well under a second. `make install` builds them ahead of the first server start.
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

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(f)
    for f in ("cpu_ops.cpp", "quant_linear.cpp", "prefill_attention.cpp")
]
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# -fopenmp: at::parallel_for runs on torch's OpenMP pool (serially without it).
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]


def build_name(headers: list[Path] = HEADERS) -> str:
    """The extension's name, with a digest of the headers in it: torch's builder rebuilds a
    cached extension when a listed source changes, not when only a header they include does."""
    digest = hashlib.sha256()
    for header in headers:
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return f"pagedserve_cpu_ops_{digest.hexdigest()[:12]}"


@functools.cache
def ops() -> ModuleType:
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # torch's builder runs `ninja` from PATH
        import ninja  # the pip package's binary, for a venv that is not activated

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    start = time.monotonic()
    module = load(
        name=build_name(),
        sources=[str(p) for p in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp", "-lm"],
        verbose=False,
    )
    if (elapsed := time.monotonic() - start) > 2:
        logger.info("built the CPU kernels in %.0f s (cached for later starts)", elapsed)
    return module
