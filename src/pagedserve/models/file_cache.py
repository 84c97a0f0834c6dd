"""Derived copies of a model file that later starts read instead of the file's slow parse (a
GGUF's tokenizer, its metadata index): under $XDG_CACHE_HOME/pagedserve (~/.cache, like the
CPU kernels), keyed by the file's path, size and modification time, so that a replaced file is
read afresh."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable


def cache_path(path: str, kind: str, name: str) -> str:
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(root, "pagedserve", kind, f"{name}-{key[:16]}")


def save(target: str, write: Callable[[str], None]) -> None:
    """`write(partial)` makes the copy (a file or a folder), which then becomes `target` whole
    or not at all (concurrent starts); a read-only home, or another start that got there
    first, leaves things as they are."""
    partial = f"{target}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        write(partial)
        os.replace(partial, target)
    except OSError:
        if os.path.isdir(partial):
            shutil.rmtree(partial, ignore_errors=True)
        elif os.path.exists(partial):
            os.remove(partial)
