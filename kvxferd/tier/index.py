"""The tier's index: which chunk holds which key, in which state, and which chunk goes first
when room is needed. Pure bookkeeping (no memory, no I/O), on the event loop only.

A chunk is the KV of one engine block (its tokens, every layer, every KV head) under one key
of one namespace. Its life:

1. **writing**: a store reserved a slot and copies into it. Invisible to lookups and loads,
   never evicted.
2. **partial** (tensor-parallel engines): some ranks' heads are in, others not yet. Invisible,
   evictable (a rank that never comes leaves nothing behind for good).
3. **complete**: every head is in. Lookups see it; a load pins it while it copies out, and a
   pinned chunk is never evicted.

Room is made least recently used first, over every namespace at once: the tier's bytes, not
each namespace's, are what the daemon promised to stay within. When a reservation would take
the tier past its high watermark, chunks are evicted until it fits under the low one, so
eviction runs in batches, not at every store.

Memory: a slot freed by eviction keeps its pages (committed) and is the first its namespace
reuses, so a namespace that churns does not fault its pages in again. Committed slots, held or
free, never exceed the limit: a slot that needs new pages first has other free slots' pages
given back (:meth:`take_released` says which; the owner releases them before any copy).

>>> index = TierIndex(limit_bytes=4096, high=1.0, low=0.5)
>>> ns = index.namespace("llama", chunk_bytes=1024, all_heads=0b1)
>>> [c.slot for c in index.reserve(ns, [b"a", b"b", b"c", b"d"], 0b1)]
[0, 1, 2, 3]
>>> index.finish(ns, [b"a", b"b", b"c", b"d"], 0b1)
>>> index.lookup(ns, [b"a", b"b", b"x"])
2
>>> [c.key for c in index.reserve(ns, [b"e"], 0b1)]  # past the high watermark: evict to the low one
[b'e']
>>> sorted(index.namespaces["llama"].free)  # c, d and a went (least recently used first); e took slot 0
[2, 3]
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["Chunk", "Namespace", "TierIndex"]


@dataclass
class Chunk:
    namespace: Namespace
    key: bytes
    slot: int
    #: Heads written so far (bit h: global KV head h), of :attr:`Namespace.all_heads`.
    heads: int = 0
    #: Stores copying into it now.
    writing: int = 0
    #: Loads copying out of it now.
    pins: int = 0

    @property
    def complete(self) -> bool:
        return self.heads == self.namespace.all_heads and not self.writing

    @property
    def evictable(self) -> bool:
        return not self.writing and not self.pins


@dataclass
class Namespace:
    name: str
    chunk_bytes: int
    all_heads: int
    #: Free slots whose pages are still committed, lowest first (reused first).
    free: list[int] = field(default_factory=list)
    #: Free slots whose pages were given back.
    released: list[int] = field(default_factory=list)
    #: Slots ever handed out (the next new one).
    made: int = 0
    chunks: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class TierIndex:
    def __init__(self, limit_bytes: int, high: float = 1.0, low: float = 0.9) -> None:
        if not 0 < low <= high <= 1:
            raise ValueError("tier watermarks: need 0 < low <= high <= 1")
        self.limit_bytes = limit_bytes
        self.high_bytes, self.low_bytes = int(limit_bytes * high), int(limit_bytes * low)
        self.used_bytes = 0
        #: Bytes of slots whose pages are committed: held ones and free ones not given back.
        self.committed_bytes = 0
        self.namespaces: dict[str, Namespace] = {}
        #: Every chunk, least recently used first.
        self._lru: OrderedDict[tuple[str, bytes], Chunk] = OrderedDict()
        #: Free slots whose pages are to be given back, since the owner last took them.
        self.released: list[tuple[Namespace, int]] = []

    def namespace(self, name: str, chunk_bytes: int, all_heads: int) -> Namespace:
        ns = self.namespaces.get(name)
        if ns is None:
            ns = self.namespaces[name] = Namespace(name, chunk_bytes, all_heads)
        return ns

    def get(self, ns: Namespace, key: bytes) -> Chunk | None:
        return self._lru.get((ns.name, key))

    def lookup(self, ns: Namespace, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, are complete chunks (each one counts as used)."""
        hits = 0
        for key in keys:
            chunk = self._lru.get((ns.name, key))
            if chunk is None or not chunk.complete:
                break
            self._lru.move_to_end((ns.name, key))
            hits += 1
        ns.hits += hits
        ns.misses += len(keys) - hits
        return hits

    def reserve(self, ns: Namespace, keys: list[bytes], heads: int) -> list[Chunk]:
        """Chunks for a store of ``heads`` under ``keys``, marked writing: a new chunk per new
        key, the partial chunk of a key whose other heads are in. Keys already holding these
        heads, or being written, are left out; so is every key from the first that finds no
        room (a prefix is what lookups can use)."""
        out: list[Chunk] = []
        for key in keys:
            chunk = self._lru.get((ns.name, key))
            if chunk is not None:
                if chunk.writing or chunk.heads & heads == heads:
                    continue
                self._lru.move_to_end((ns.name, key))
            else:
                slot = self._slot(ns)
                if slot is None:
                    break
                chunk = Chunk(ns, key, slot)
                self._lru[(ns.name, key)] = chunk
                ns.chunks += 1
            chunk.writing += 1
            out.append(chunk)
        return out

    def finish(self, ns: Namespace, keys: list[bytes], heads: int, ok: bool = True) -> None:
        """A store of ``heads`` into these keys' reserved chunks ended (``ok``: every byte is
        in); a failed one leaves its chunks out (dropped, unless other heads are in)."""
        for key in keys:
            chunk = self._lru.get((ns.name, key))
            if chunk is None or not chunk.writing:
                continue
            chunk.writing -= 1
            if ok:
                chunk.heads |= heads
            elif not chunk.heads:
                self._drop(chunk)

    def pin(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            chunk.pins += 1

    def unpin(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            chunk.pins -= 1

    def take_released(self) -> list[tuple[Namespace, int]]:
        out, self.released = self.released, []
        return out

    def _slot(self, ns: Namespace) -> int | None:
        """A free slot of ``ns``, after evicting down to the low watermark if the tier would
        pass its high one; None when even that leaves no room."""
        if self.used_bytes + ns.chunk_bytes > self.high_bytes:
            self._evict_until(self.low_bytes - ns.chunk_bytes)
        if self.used_bytes + ns.chunk_bytes > self.limit_bytes:
            return None
        self.used_bytes += ns.chunk_bytes
        if ns.free:
            return heapq.heappop(ns.free)  # its pages are still there
        self._reclaim(ns.chunk_bytes)
        self.committed_bytes += ns.chunk_bytes
        if ns.released:
            return heapq.heappop(ns.released)
        ns.made += 1
        return ns.made - 1

    def _reclaim(self, need: int) -> None:
        """Give back free slots' pages until ``need`` more bytes fit within the limit (there
        are enough: every byte committed and not held is a free slot's)."""
        for ns in self.namespaces.values():
            while ns.free and self.committed_bytes + need > self.limit_bytes:
                slot = heapq.heappop(ns.free)
                heapq.heappush(ns.released, slot)
                self.committed_bytes -= ns.chunk_bytes
                self.released.append((ns, slot))

    def _evict_until(self, target_bytes: int) -> None:
        for chunk in list(self._lru.values()):
            if self.used_bytes <= target_bytes:
                return
            if chunk.evictable:
                self._drop(chunk)
                chunk.namespace.evictions += 1

    def _drop(self, chunk: Chunk) -> None:
        ns = chunk.namespace
        del self._lru[(ns.name, chunk.key)]
        heapq.heappush(ns.free, chunk.slot)
        ns.chunks -= 1
        self.used_bytes -= ns.chunk_bytes
