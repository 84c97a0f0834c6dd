"""Which CPU this is, and which kernel level its C++ kernels are built and dispatched for.

Levels, lowest first: `generic` (portable C++ the compiler vectorises: any architecture),
`avx2` (AVX2 + FMA + F16C), `avx512` (AVX-512 F/BW/VL/DQ, with BF16 and VNNI where the CPU has
them), `amx` (Intel AMX tiles with AVX-512 BF16). A level is a compile target (explicit -m
flags, never -march=native, so a binary runs on any CPU of its level) and a run-time choice:
the highest the CPU has, capped by PAGEDSERVE_CPU_ISA so one machine exercises every level
below its own.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from dataclasses import dataclass

logger = logging.getLogger(__name__)

LEVELS = ("generic", "avx2", "avx512", "amx")
CAP_ENV = "PAGEDSERVE_CPU_ISA"
# CPU features (/proc/cpuinfo names, comma-separated) to treat as absent: one machine then
# builds and tests what a CPU without them gets, e.g. avx512 without VNNI and BF16 (Skylake-SP).
FLAGS_OFF_ENV = "PAGEDSERVE_CPU_FLAGS_OFF"

# /proc/cpuinfo flags each x86 level needs.
_REQUIRED = {
    "avx2": ("avx2", "fma", "f16c", "bmi2"),
    "avx512": ("avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "amx": (
        *("avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
        *("avx512_bf16", "amx_tile", "amx_bf16"),
    ),
}
_FLAGS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mbmi2"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mbmi2"]
    + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"],
}
_FLAGS["amx"] = [*_FLAGS["avx512"], "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"]
# Optional features a level uses where the CPU has them: AVX-VNNI's 256-bit integer products
# at avx2 (Intel from Alder Lake and Sapphire Rapids on, AMD Zen 5); BF16 and VNNI at avx512
# (AMD Zen 4 has both).
_EXTRAS = {
    "avx2": {"avx_vnni": "-mavxvnni"},
    "avx512": {"avx512_bf16": "-mavx512bf16", "avx512_vnni": "-mavx512vnni"},
}


@dataclass(frozen=True)
class CpuInfo:
    model: str
    arch: str  # platform.machine(): x86_64, aarch64, ...
    flags: frozenset[str]

    @property
    def best_level(self) -> str:
        if self.arch not in ("x86_64", "AMD64"):
            return "generic"
        best = "generic"
        for level in LEVELS[1:]:
            if all(f in self.flags for f in _REQUIRED[level]):
                best = level
        return best

    def has_native_bf16(self) -> bool:
        """Whether this CPU computes bfloat16 products itself (not emulated in float32)."""
        if self.arch in ("aarch64", "arm64"):
            return "bf16" in self.flags
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    def missing_for(self, level: str) -> list[str]:
        return [f for f in _REQUIRED.get(level, ()) if f not in self.flags]


def _read_cpuinfo() -> CpuInfo:
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:  # not Linux: no feature list, so the portable level
        pass
    return CpuInfo(model or platform.machine(), platform.machine(), flags)


@functools.cache
def cpu_info() -> CpuInfo:
    cpu = _read_cpuinfo()
    off = {f.strip() for f in os.environ.get(FLAGS_OFF_ENV, "").split(",") if f.strip()}
    if not off & cpu.flags:
        return cpu
    model = f"{cpu.model} without {','.join(sorted(off & cpu.flags))}"
    return CpuInfo(model, cpu.arch, cpu.flags - off)


def levels_supported(cpu: CpuInfo | None = None) -> list[str]:
    """Every level this CPU can run, lowest first."""
    cpu = cpu or cpu_info()
    return list(LEVELS[: LEVELS.index(cpu.best_level) + 1])


@functools.cache
def kernel_level() -> str:
    """The level this process builds and dispatches: the CPU's best, capped by $PAGEDSERVE_CPU_ISA
    (a level above the CPU's is refused, naming what it lacks)."""
    cpu = cpu_info()
    best = cpu.best_level
    cap = os.environ.get(CAP_ENV, "").strip().lower()
    if not cap:
        return best
    if cap not in LEVELS:
        raise ValueError(f"{CAP_ENV}={cap!r}: expected one of {', '.join(LEVELS)}")
    if LEVELS.index(cap) > LEVELS.index(best):
        missing = ", ".join(cpu.missing_for(cap)) or "x86-64"
        raise ValueError(f"{CAP_ENV}={cap}: this CPU ({cpu.model}) lacks {missing}")
    return cap


def native_bf16(level: str | None = None) -> bool:
    """Whether bfloat16 is computed natively at `level` (default: this process's level): the
    CPU has it, and the level's kernels use it (a capped avx2 or generic build does not)."""
    level = level or kernel_level()
    cpu = cpu_info()
    if not cpu.has_native_bf16():
        return False
    return level in ("amx", "avx512") or cpu.arch in ("aarch64", "arm64")


def compile_flags(level: str, cpu: CpuInfo | None = None) -> list[str]:
    cpu = cpu or cpu_info()
    extras = _EXTRAS.get(level, {})
    return _FLAGS[level] + [flag for feature, flag in extras.items() if feature in cpu.flags]


def optional_features(level: str) -> frozenset[str]:
    """The CPU features (/proc/cpuinfo names) a build at `level` uses where the CPU has them."""
    return frozenset(_EXTRAS.get(level, {}))


def target_tag(level: str, cpu: CpuInfo | None = None) -> str:
    """A short name for what a build at `level` targets on this CPU: the level and a digest of
    the CPU's model and its compile flags, so that a cache shared by machines never hands one
    CPU another's binary."""
    cpu = cpu or cpu_info()
    digest = hashlib.sha256(
        f"{cpu.arch}|{cpu.model}|{' '.join(compile_flags(level, cpu))}".encode()
    )
    return f"{level}_{digest.hexdigest()[:8]}"


def describe() -> str:
    cpu = cpu_info()
    return f"{cpu.model} ({cpu.arch}), CPU kernel level {kernel_level()}"
