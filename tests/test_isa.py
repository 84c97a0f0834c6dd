"""CPU detection, kernel levels, their cap, and the CPU dtype that follows from them."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.cpu_kernels import isa
from pagedserve.engine import _pick_dtype, _pick_kv_dtype

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
ZEN3 = isa.CpuInfo("AMD EPYC 7763 64-Core Processor", "x86_64", frozenset(AVX2))
ALDER_LAKE = isa.CpuInfo(
    "12th Gen Intel(R) Core(TM) i7-1260P", "x86_64", frozenset(AVX2 | {"avx_vnni"})
)
ZEN4 = isa.CpuInfo("AMD EPYC 9R14", "x86_64", frozenset(AVX512 | {"avx512_bf16"}))
SKYLAKE = isa.CpuInfo("Intel Xeon Gold 6148", "x86_64", frozenset(AVX512 - {"avx512_vnni"}))
AMX = {"avx512_bf16", "amx_tile", "amx_bf16"}
SAPPHIRE = isa.CpuInfo("Intel Xeon Platinum 8480", "x86_64", frozenset(AVX512 | AMX))
GRAVITON = isa.CpuInfo("Neoverse-V1", "aarch64", frozenset({"asimd", "bf16", "sve"}))


@pytest.mark.parametrize(
    ("cpu", "best", "bf16"),
    [
        (ZEN3, "avx2", False),
        (ZEN4, "avx512", True),
        (SKYLAKE, "avx512", False),
        (SAPPHIRE, "amx", True),
        (GRAVITON, "generic", True),
        (isa.CpuInfo("old", "x86_64", frozenset({"sse2", "avx"})), "generic", False),
    ],
)
def test_levels_follow_the_cpu_flags(cpu, best, bf16):
    assert cpu.best_level == best
    assert isa.levels_supported(cpu) == list(isa.LEVELS[: isa.LEVELS.index(best) + 1])
    assert cpu.has_native_bf16() is bf16


def test_builds_are_named_by_level_and_cpu():
    assert "-mavx512bf16" in isa.compile_flags("avx512", ZEN4)
    assert "-mavx512bf16" not in isa.compile_flags("avx512", SKYLAKE)
    assert isa.compile_flags("avx2", ZEN4) == isa.compile_flags("avx2", ZEN3)
    assert isa.compile_flags("avx2", ALDER_LAKE) == [*isa.compile_flags("avx2", ZEN3), "-mavxvnni"]
    assert ALDER_LAKE.best_level == "avx2"
    assert not any(f.startswith("-march") for lv in isa.LEVELS for f in isa.compile_flags(lv))
    tags = {isa.target_tag(lv, cpu) for lv in isa.LEVELS for cpu in (ZEN3, ZEN4, SAPPHIRE)}
    assert len(tags) == 3 * len(isa.LEVELS)  # never one CPU's binary for another
    assert isa.target_tag("avx2", ZEN3).startswith("avx2_")


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to run on `cpu`, with the process's level as it would pick it (cap included)."""

    def use(info: isa.CpuInfo) -> None:
        monkeypatch.setattr(isa, "cpu_info", lambda: info)
        isa.kernel_level.cache_clear()

    yield use
    isa.kernel_level.cache_clear()


def test_features_turned_off_are_absent_from_levels_and_builds(monkeypatch):
    """PAGEDSERVE_CPU_FLAGS_OFF: a Sapphire Rapids seen as a Skylake-SP (no VNNI, BF16, AMX)."""
    monkeypatch.setattr(isa, "_read_cpuinfo", lambda: SAPPHIRE)
    monkeypatch.setenv(isa.FLAGS_OFF_ENV, "avx512_vnni, avx512_bf16,amx_tile,amx_bf16,sse9")
    isa.cpu_info.cache_clear()
    try:
        seen = isa.cpu_info()
        assert seen.best_level == "avx512" and not seen.has_native_bf16()
        assert seen.flags == SKYLAKE.flags
        assert seen.model == f"{SAPPHIRE.model} without amx_bf16,amx_tile,avx512_bf16,avx512_vnni"
        assert isa.compile_flags("avx512", seen) == isa.compile_flags("avx512", SKYLAKE)
        assert isa.target_tag("avx512", seen) != isa.target_tag("avx512", SAPPHIRE)
        monkeypatch.setenv(isa.FLAGS_OFF_ENV, "")
        isa.cpu_info.cache_clear()
        assert isa.cpu_info() == SAPPHIRE
    finally:
        isa.cpu_info.cache_clear()


def test_the_cap_lowers_the_level_and_refuses_to_raise_it(cpu, monkeypatch):
    cpu(SAPPHIRE)
    monkeypatch.setenv(isa.CAP_ENV, "avx2")
    assert isa.kernel_level() == "avx2" and not isa.native_bf16()
    cpu(ZEN3)
    monkeypatch.setenv(isa.CAP_ENV, "avx512")
    with pytest.raises(ValueError, match="lacks avx512f, avx512bw, avx512vl, avx512dq"):
        isa.kernel_level()
    cpu(ZEN3)
    monkeypatch.setenv(isa.CAP_ENV, "sse9")
    with pytest.raises(ValueError, match="expected one of generic, avx2, avx512, amx"):
        isa.kernel_level()


@pytest.mark.parametrize(
    ("info", "cap", "auto"),
    [
        (ZEN3, "", torch.float32),
        (ZEN4, "", torch.bfloat16),
        (SKYLAKE, "", torch.float32),
        (SAPPHIRE, "", torch.bfloat16),
        (SAPPHIRE, "avx512", torch.bfloat16),
        (SAPPHIRE, "avx2", torch.float32),
        (GRAVITON, "", torch.bfloat16),
    ],
)
def test_cpu_dtype_auto_is_bfloat16_only_where_native(cpu, monkeypatch, info, cap, auto):
    cpu(info)
    monkeypatch.setenv(isa.CAP_ENV, cap)
    cpu_device = torch.device("cpu")
    assert _pick_dtype("auto", cpu_device) == auto
    assert _pick_dtype("float32", cpu_device) == torch.float32
    if auto == torch.bfloat16:
        assert _pick_dtype("bfloat16", cpu_device) == torch.bfloat16
    else:
        with pytest.raises(ValueError, match="--dtype bfloat16 needs native bfloat16") as err:
            _pick_dtype("bfloat16", cpu_device)
        assert ("capped at avx2" if cap else "has no AVX512_BF16 or AMX-BF16") in str(err.value)


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("options", "dtype", "device", "kv"),
    [
        ({}, torch.float32, CPU, torch.float16),  # auto came out float32: llama.cpp's pages
        ({"dtype": "float32"}, torch.float32, CPU, torch.float32),  # named: exact
        ({}, torch.bfloat16, CPU, torch.bfloat16),
        ({}, torch.bfloat16, CUDA, torch.bfloat16),
        ({"attention_backend": "triton"}, torch.float32, CPU, torch.float32),
        ({"dtype": "float32", "kv_cache_dtype": "float16"}, torch.float32, CPU, torch.float16),
        ({"kv_cache_dtype": "bfloat16"}, torch.float32, CPU, torch.bfloat16),
        ({"kv_cache_dtype": "float32"}, torch.float32, CPU, torch.float32),
        ({"kv_cache_dtype": "bfloat16"}, torch.bfloat16, CUDA, torch.bfloat16),
        ({"kv_cache_dtype": "int8"}, torch.bfloat16, CPU, torch.int8),
        ({"kv_cache_dtype": "int8"}, torch.float32, CPU, torch.int8),
    ],
)
def test_kv_cache_dtype(cpu, monkeypatch, options, dtype, device, kv):
    cpu(SAPPHIRE)
    monkeypatch.setenv(isa.CAP_ENV, "avx2")
    assert _pick_kv_dtype(EngineConfig(**options), dtype, device) == kv


def test_kv_cache_dtype_auto_is_bfloat16_under_float32_at_the_generic_level(cpu, monkeypatch):
    """The portable kernels widen bfloat16 by a shift, float16 by bit operations."""
    cpu(ZEN3)
    for cap, kv in [("", torch.float16), ("generic", torch.bfloat16)]:
        monkeypatch.setenv(isa.CAP_ENV, cap)
        isa.kernel_level.cache_clear()
        assert _pick_kv_dtype(EngineConfig(), torch.float32, CPU) == kv
        assert _pick_kv_dtype(EngineConfig(dtype="float32"), torch.float32, CPU) == torch.float32


@pytest.mark.parametrize(
    ("options", "dtype", "device"),
    [
        ({"kv_cache_dtype": "float32"}, torch.bfloat16, CPU),
        ({"kv_cache_dtype": "float16"}, torch.bfloat16, CPU),
        ({"kv_cache_dtype": "float16"}, torch.bfloat16, CUDA),
        ({"kv_cache_dtype": "float16", "attention_backend": "triton"}, torch.float32, CPU),
        ({"kv_cache_dtype": "int8"}, torch.bfloat16, CUDA),
        ({"kv_cache_dtype": "int8", "attention_backend": "triton"}, torch.bfloat16, CPU),
    ],
)
def test_kv_cache_dtype_the_kernels_cannot_read_is_refused(options, dtype, device):
    with pytest.raises(ValueError, match="float16 or bfloat16 under float32, read by the CPU"):
        _pick_kv_dtype(EngineConfig(**options), dtype, device)


def test_a_build_lock_left_by_a_killed_build_does_not_block_a_start():
    """torch's builder waits forever on the lock file of a build that was killed. A start
    whose library is current imports it without the builder; one whose library is not (its
    stamp gone) runs the builder, which must clear the stale lock and stamp the library."""
    import os
    import subprocess
    import sys

    from torch.utils.cpp_extension import get_default_build_root

    from pagedserve.cpu_kernels import STAMP, build_name, ops

    ops()  # built and cached
    level = isa.kernel_level()
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    build_dir = os.path.join(root, f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    build_dir = os.path.join(build_dir, build_name(level))
    lock, stamp = os.path.join(build_dir, "lock"), os.path.join(build_dir, STAMP)
    code = f"""
import sys
from pagedserve.cpu_kernels import ops_for
print(ops_for({level!r}).kernel_level(), "torch.utils.cpp_extension" in sys.modules)
"""

    def start() -> str:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
        )
        return out.stdout.strip() or out.stderr[-2000:]

    open(lock, "w").close()
    assert start() == f"{level} False"  # current: imported directly
    os.unlink(stamp)
    assert start() == f"{level} True"  # the builder ran (nothing to compile) and cleared the lock
    assert not os.path.exists(lock) and os.path.exists(stamp)
    assert start() == f"{level} False"
