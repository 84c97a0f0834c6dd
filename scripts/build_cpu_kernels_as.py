"""Build this working tree's CPU kernels under another module name, to load beside another
build in one process (`bench_cpu_block_linear.py --builds A.so,B.so`): on a VM whose speed
swings from one minute to the next, calls alternated within one process compare two builds
where separate runs cannot. Prints the library's path.

    python scripts/build_cpu_kernels_as.py NAME [--level LEVEL] [--root /tmp/pagedserve_builds]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torch.utils.cpp_extension import load

from pagedserve.cpu_kernels import BASE_CFLAGS, SOURCES, compile_flags, kernel_level


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the module's name (a Python identifier)")
    parser.add_argument("--level", default=None, help="kernel level (default: this CPU's)")
    parser.add_argument("--root", default="/tmp/pagedserve_builds")
    args = parser.parse_args()
    build_dir = Path(args.root) / args.name
    build_dir.mkdir(parents=True, exist_ok=True)
    load(
        name=args.name,
        sources=[str(p) for p in SOURCES],
        extra_cflags=[*BASE_CFLAGS, *compile_flags(args.level or kernel_level())],
        extra_ldflags=["-fopenmp", "-lm"],
        build_directory=str(build_dir),
        verbose=False,
    )
    print(build_dir / f"{args.name}.so")


if __name__ == "__main__":
    main()
