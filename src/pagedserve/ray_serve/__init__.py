"""Data parallelism: N engine replicas as one Ray Serve application (`--data-parallel-size N`).

Nothing here is imported by the single-process server; only `config` and `relay` (plain data)
import without Ray.
"""
