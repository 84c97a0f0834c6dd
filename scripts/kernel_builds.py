"""Load a build of the CPU kernels from scripts/build_cpu_kernels_as.py into this process, beside
another, for the benchmarks' --builds comparisons."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_build(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
