"""The CPU kernels' sources built for ARM64 (the generic level's main users: Graviton, Apple
silicon) by a cross compiler, zig's clang, on this x86 machine: every source compiles, and the
portable integer products come out as NEON multiply-accumulates, not scalar code."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedserve.cpu_kernels import SOURCES

TARGET = "aarch64-linux-gnu"


def include_flags(tmp: Path) -> list[str]:
    """torch's and Python's headers, and OpenMP's (ATen's parallel header includes it; zig
    ships none): the host GCC's copy, which only declares the runtime's functions."""
    from torch.utils.cpp_extension import include_paths

    gcc_include = subprocess.run(
        ["gcc", "-print-file-name=include"], capture_output=True, text=True, check=True
    ).stdout.strip()
    shutil.copy(Path(gcc_include) / "omp.h", tmp / "omp.h")
    paths = [*include_paths(), sysconfig.get_paths()["include"], str(tmp)]
    return [f"-I{p}" for p in paths]


def cross_compile(source: Path, includes: list[str], out: Path) -> subprocess.CompletedProcess:
    # -O1: the vectorizer runs; code generation for ATen's templates stays ~10 s a file.
    flags = ["-target", TARGET, "-std=c++17", "-O1", "-ffast-math", *includes]
    return subprocess.run(
        [sys.executable, "-m", "ziglang", "c++", *flags, "-S", "-o", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.timeout(900)
def test_kernel_sources_build_for_arm64_with_neon_integer_products(tmp_path):
    includes = include_flags(tmp_path)
    with ThreadPoolExecutor(max_workers=2) as pool:  # the machine's two cores
        done = dict(
            zip(
                SOURCES,
                pool.map(lambda s: cross_compile(s, includes, tmp_path / f"{s.stem}.s"), SOURCES),
                strict=True,
            )
        )
    failed = {s.name: p.stderr[-2000:] for s, p in done.items() if p.returncode != 0}
    assert not failed, failed
    # quant_linear_int8.cpp's portable sums (16-bit lanes times the activation pair): NEON's
    # 8-lane multiply-accumulate, several a group.
    asm = (tmp_path / "quant_linear_int8.s").read_bytes().decode(errors="replace")
    assert len(re.findall(r"\bmla\s+v\d+\.8h", asm)) >= 32
