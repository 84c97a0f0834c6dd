"""Fused C++ kernels for CPU steps, one build per kernel level (cpu_kernels/isa.py), compiled
on first use and cached.

torch's extension builder compiles the sources with the level's -m flags into
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR) once; later processes load the cached
library in well under a second. `make install` builds this machine's level ahead of the first
server start. Each source holds every level's code behind the compiler's feature macros
(__AMX_TILE__, __AVX512F__, __AVX2__), so one set of files serves all levels.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

from pagedserve.cpu_kernels.isa import compile_flags, kernel_level, target_tag

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))  # each holds every level's code
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# -fopenmp: at::parallel_for runs on torch's OpenMP pool (serially without it).
BASE_CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]
# In a build's folder: the digest of the inputs its library was built from, and our build lock.
STAMP, FLOCK = "pagedserve.inputs", "pagedserve.flock"


def build_name(level: str, headers: list[Path] = HEADERS) -> str:
    """The extension's name: its level and target CPU (isa.target_tag), and a digest of the
    headers, since torch's builder rebuilds a cached extension when a listed source changes,
    not when only a header they include does."""
    digest = hashlib.sha256()
    for header in headers:
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return f"pagedserve_cpu_ops_{target_tag(level)}_{digest.hexdigest()[:12]}"


def _build_root() -> Path:
    """Where builds are kept: torch's default root, found without importing its builder."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(cache) / "torch_extensions"
    return Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


def _inputs_digest(level: str) -> str:
    """What a build is made of: sources, headers, flags and torch's version."""
    import torch

    digest = hashlib.sha256(f"{torch.__version__}\0{BASE_CFLAGS}\0{compile_flags(level)}".encode())
    for path in [*SOURCES, *HEADERS]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def import_library(path: Path | str, name: str | None = None) -> ModuleType:
    """The compiled extension at path (its module name: the file's stem unless given); the
    benchmarks' --builds load two builds of the kernels with it."""
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def ops_for(level: str) -> ModuleType:
    """The kernels built for `level` (which this CPU must support)."""
    name = build_name(level)
    build_dir = _build_root() / name
    library, stamp = build_dir / f"{name}.so", build_dir / STAMP
    inputs = _inputs_digest(level)
    module = None
    # A library built from these very inputs is imported directly: torch's builder costs a
    # start-up 0.2 s (it imports setuptools) only to find that nothing changed. The shared
    # lock keeps a build for other inputs (another checkout's sources) from running meanwhile.
    if library.exists():
        with open(build_dir / FLOCK, "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_SH)
            if stamp.exists() and stamp.read_text() == inputs:
                module = import_library(library, name)
    if module is None:
        module = _build(level, name, build_dir, inputs)
    if module.kernel_level() != level:
        raise RuntimeError(f"the {level} build reports level {module.kernel_level()}")
    return module


def _build(level: str, name: str, build_dir: Path, inputs: str) -> ModuleType:
    """Build (or bring up to date) and import the extension with torch's builder, then stamp
    the library with the digest of its inputs."""
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # torch's builder runs `ninja` from PATH
        import ninja  # the pip package's binary, for a venv that is not activated

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    # torch's builder guards a build with a lock file that a killed build leaves behind, and
    # every later start then waits on it forever. An flock, which dies with its process,
    # serializes our builds instead; whoever holds it knows any lock file left is stale.
    with open(build_dir / FLOCK, "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        module = load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=[*BASE_CFLAGS, *compile_flags(level)],
            extra_ldflags=["-fopenmp", "-lm"],
            build_directory=str(build_dir),
            verbose=False,
        )
        (build_dir / STAMP).write_text(inputs)
    if (elapsed := time.monotonic() - start) > 2:
        logger.info("built the %s CPU kernels in %.0f s (cached for later starts)", level, elapsed)
    return module


def ops() -> ModuleType:
    """The kernels of this process's level."""
    return ops_for(kernel_level())
