"""The KV page pool: free list, reference counts, prefix-cache hashes and LRU eviction.

Pages are ids into the K/V tensors that attention backends own; nothing here touches tensors.
A full page is identified by a hash of its tokens chained with its predecessor's hash, so two
sequences with the same leading tokens share the same pages. Free pages that still hold a cached
prefix stay findable until they are taken for new tokens, oldest-freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedserve.sequence import Sequence


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


@dataclass
class Page:
    page_id: int
    ref_count: int = 0
    block_hash: int | None = None
    tokens: tuple[int, ...] | None = None  # kept to rule out hash collisions


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pages = [Page(i) for i in range(num_pages)]
        # Pages with ref_count 0, in eviction order (least recently freed first).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))
        self._cached: dict[int, int] = {}  # block hash -> page id
        self.prefix_stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        """Pages held by live sequences (cached-only pages count as free)."""
        return self.num_pages - len(self._free)

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- prefix cache --------------------------------------------------------------------
    def _page_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of every full page of the sequence's known tokens (memoised)."""
        n_full = seq.num_tokens // self.page_size
        hashes = seq.block_hashes
        while len(hashes) < n_full:
            i = len(hashes)
            tokens = tuple(seq.token_ids_slice(i * self.page_size, (i + 1) * self.page_size))
            hashes.append(chain_hash(hashes[-1] if hashes else None, tokens))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Page ids holding the longest cached prefix, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        size = self.page_size
        max_pages = (seq.num_tokens - 1) // size  # the last token is always computed
        for i, h in enumerate(self._page_hashes(seq)[:max_pages]):
            page_id = self._cached.get(h)
            tokens = tuple(seq.token_ids_slice(i * size, (i + 1) * size))
            if page_id is None or self.pages[page_id].tokens != tokens:
                break
            hits.append(page_id)
        return hits

    def cache_full_pages(self, seq: Sequence) -> None:
        """Register pages whose tokens are all computed, so later sequences can share them
        (only the pages filled since the last call: the cost of a step, not of the sequence)."""
        if not self.enable_prefix_caching:
            return
        n_full = seq.num_computed_tokens // self.page_size
        if n_full <= seq.num_registered_pages:
            return
        hashes = self._page_hashes(seq)
        for i in range(seq.num_registered_pages, n_full):
            page = self.pages[seq.block_table[i]]
            if page.block_hash is not None:
                continue
            h = hashes[i]
            if h in self._cached:  # an identical page computed concurrently: keep the first
                continue
            page.block_hash = h
            page.tokens = tuple(seq.token_ids_slice(i * self.page_size, (i + 1) * self.page_size))
            self._cached[h] = page.page_id
        seq.num_registered_pages = n_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page that no sequence holds; False if some are still in use."""
        for page_id in list(self._free):
            self._uncache(self.pages[page_id])
        return not self._cached

    def _uncache(self, page: Page) -> None:
        if page.block_hash is not None and self._cached.get(page.block_hash) == page.page_id:
            del self._cached[page.block_hash]
        page.block_hash = None
        page.tokens = None

    # ---- allocation ----------------------------------------------------------------------
    def _take_free_page(self) -> Page:
        page_id, _ = self._free.popitem(last=False)
        page = self.pages[page_id]
        self._uncache(page)  # evict: its contents are about to be overwritten
        page.ref_count = 1
        return page

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int]) -> bool:
        reused_free = sum(1 for p in cached if self.pages[p].ref_count == 0)
        total = seq.num_computed_tokens + len(cached) * self.page_size + num_new_tokens
        new_pages = self.pages_needed(total) - len(seq.block_table) - len(cached)
        return new_pages + reused_free <= self.num_free_pages

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give `seq` pages for `num_new_tokens` more tokens, first adopting `cached` prefix pages
        (only on a sequence with nothing computed; the scheduler then counts them computed).
        Returns False, changing nothing, if the pool cannot hold them."""
        if not self.can_allocate(seq, num_new_tokens, list(cached)):
            return False
        for page_id in cached:
            page = self.pages[page_id]
            if page.ref_count == 0:
                del self._free[page_id]
            page.ref_count += 1
            seq.block_table.append(page_id)
        total = seq.num_computed_tokens + len(cached) * self.page_size + num_new_tokens
        need = self.pages_needed(total) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take_free_page().page_id)
        return True

    def record_prefix_query(self, num_tokens: int, num_hits: int) -> None:
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hits

    def free(self, seq: Sequence) -> None:
        """Return a sequence's pages; its tail pages are evicted before its prefix pages."""
        for page_id in reversed(seq.block_table):
            page = self.pages[page_id]
            page.ref_count -= 1
            if page.ref_count == 0:
                if page.block_hash is None:
                    # Nothing to keep: reuse it before any cached page.
                    self._free[page_id] = None
                    self._free.move_to_end(page_id, last=False)
                else:
                    self._free[page_id] = None
        seq.block_table = []
        seq.num_registered_pages = 0
