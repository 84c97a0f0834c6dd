"""Benchmarks: offline (in process) and, later, against a running server."""
