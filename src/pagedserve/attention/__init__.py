"""Attention backends: write new K/V into pages and attend over them."""

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.attention.registry import get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
