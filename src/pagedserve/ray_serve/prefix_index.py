"""Which replica was last sent which prompt prefixes: the router's memory of where prefix pages
are likely cached. Prompts are cut into fixed blocks of characters, each block's hash chained
with its predecessor's (as the block manager chains its page hashes), so one block's hash
stands for the whole prefix up to it. No Ray here."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

BLOCK_CHARS = 64  # about 16 tokens of English: one KV page of the default block size
CAPACITY_BLOCKS = 200_000  # ~13 M characters of prefixes remembered, a few tens of MB


def block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Chained hashes of the text's full blocks (a partial last block is never a cached page)."""
    hashes, h = [], 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = hash((h, text[start : start + block_chars]))
        hashes.append(h)
    return hashes


class PrefixIndex:
    """Block hash -> the replicas sent a prompt through that block, least recently used first
    out once over capacity (the engines evict their cached pages least recently used too)."""

    def __init__(self, capacity: int = CAPACITY_BLOCKS):
        self.capacity = capacity
        self._owners: OrderedDict[int, set[str]] = OrderedDict()
        self._held: Counter[str] = Counter()  # blocks remembered per replica

    def insert(self, hashes: Iterable[int], replica: str) -> None:
        for h in hashes:
            owners = self._owners.get(h)
            if owners is None:
                owners = self._owners[h] = set()
            else:
                self._owners.move_to_end(h)
            if replica not in owners:
                owners.add(replica)
                self._held[replica] += 1
        while len(self._owners) > self.capacity:
            _, owners = self._owners.popitem(last=False)
            self._held.subtract(owners)

    def matched_blocks(self, hashes: list[int], replicas: Iterable[str]) -> dict[str, int]:
        """Leading blocks of the prompt each replica was sent (0 for none). The deepest block a
        replica owns counts, whatever eviction did to the blocks before it: the chain hash
        already proves the prefix."""
        wanted = set(replicas)
        matched = dict.fromkeys(wanted, 0)
        for depth in range(len(hashes), 0, -1):
            owners = self._owners.get(hashes[depth - 1])
            if not owners:
                continue
            for r in owners & wanted:
                matched[r] = depth
            wanted -= owners
            if not wanted:
                break
        return matched

    def held(self, replica: str) -> int:
        return self._held[replica]

    def forget(self, replica: str) -> None:
        """A replica is gone: a new one in its place starts with an empty cache."""
        for h in [h for h, owners in self._owners.items() if replica in owners]:
            owners = self._owners[h]
            owners.discard(replica)
            if not owners:
                del self._owners[h]
        self._held.pop(replica, None)
