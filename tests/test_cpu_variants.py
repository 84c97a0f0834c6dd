"""The avx512 level as CPUs with fewer AVX-512 extensions than this one build and run it.

The avx512 build takes VNNI and BF16 where the CPU has them (isa.compile_flags), so its code
differs between a Skylake-SP (neither), a Cascade Lake or Ice Lake-SP (VNNI, no BF16) and an
AMD Zen 4 (both). Each variant this CPU can stand in for (PAGEDSERVE_CPU_FLAGS_OFF) builds its
own kernels and passes the kernel tests at avx512 in a process of its own.
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
VARIANTS = {  # name: the features it lacks
    "skylake_sp": ("avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"),
    "cascade_lake": ("avx512_bf16", "amx_tile", "amx_bf16"),
}


def stands_in_for(lacks: tuple[str, ...]) -> bool:
    """Whether this CPU runs the avx512 level and has a feature the variant lacks that
    changes the avx512 build (AMX alone does not: its level is another build)."""
    cpu = isa.cpu_info()
    changes = {"avx512_vnni", "avx512_bf16"} & set(lacks)
    return "avx512" in isa.levels_supported(cpu) and bool(changes & cpu.flags)


@pytest.mark.timeout(900)  # a variant's first use compiles its kernels (~1 minute when idle)
@pytest.mark.parametrize("variant", VARIANTS)
def test_kernels_at_avx512_on_a_cpu_with_fewer_extensions(variant):
    lacks = VARIANTS[variant]
    if not stands_in_for(lacks):
        pytest.skip(f"this CPU ({isa.cpu_info().model}) runs no different avx512 build")
    env = {**os.environ, isa.FLAGS_OFF_ENV: ",".join(lacks)}
    env.pop(isa.CAP_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "avx512"]
        + [str(TESTS / name) for name in KERNEL_TESTS],
        env=env,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1]
