"""Levels as CPUs with fewer optional extensions than this one build and run them.

A level's build takes some features where the CPU has them (isa.optional_features): the avx512
build differs between a Skylake-SP (neither VNNI nor BF16), a Cascade Lake or Ice Lake-SP (VNNI,
no BF16) and an AMD Zen 4 (both); the avx2 build between a CPU with AVX-VNNI (Intel from Alder
Lake and Sapphire Rapids on, AMD Zen 5) and one without (AMD Zen 3, Intel Haswell to Ice Lake).
Each variant this CPU can stand in for (PAGEDSERVE_CPU_FLAGS_OFF) builds its own kernels and
passes the kernel tests at its level in a process of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.cpu_kernels import isa

TESTS = Path(__file__).parent
KERNEL_TESTS = ["test_quant_linear.py", "test_kquant_linear.py", "test_cpu_kernels.py"]
VARIANTS = {  # name: the level, the features it lacks
    "skylake_sp": ("avx512", ("avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")),
    "cascade_lake": ("avx512", ("avx512_bf16", "amx_tile", "amx_bf16")),
    "avx2_without_avx_vnni": ("avx2", ("avx_vnni",)),
}


def stands_in_for(level: str, lacks: tuple[str, ...]) -> bool:
    """Whether this CPU runs `level` and has a feature the variant lacks that changes the
    level's build (AMX alone does not: its level is another build)."""
    cpu = isa.cpu_info()
    changes = isa.optional_features(level) & set(lacks)
    return level in isa.levels_supported(cpu) and bool(changes & cpu.flags)


@pytest.mark.timeout(900)  # a variant's first use compiles its kernels (~1 minute when idle)
@pytest.mark.parametrize("variant", VARIANTS)
def test_kernels_on_a_cpu_with_fewer_extensions(variant):
    level, lacks = VARIANTS[variant]
    if not stands_in_for(level, lacks):
        pytest.skip(f"this CPU ({isa.cpu_info().model}) runs no different {level} build")
    env = {**os.environ, isa.FLAGS_OFF_ENV: ",".join(lacks)}
    env.pop(isa.CAP_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", level]
        + [str(TESTS / name) for name in KERNEL_TESTS],
        env=env,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1]
