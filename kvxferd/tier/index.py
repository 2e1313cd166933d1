"""The tier's index: which chunk holds which key, where (host memory, disk, both), in which
state, and which chunk goes first when room is needed. Pure bookkeeping (no memory, no I/O),
on the event loop only.

A chunk is the KV of one engine block (its tokens, every layer, every KV head) under one key
of one namespace. Its life:

1. **writing**: a store reserved a host slot and copies into it. Invisible to lookups and
   loads, never evicted.
2. **partial** (tensor-parallel engines): some ranks' heads are in, others not yet. Invisible,
   evictable (a rank that never comes leaves nothing behind for good).
3. **complete**: every head is in. Lookups see it; a load pins it while it copies out, and a
   pinned chunk is never evicted.

With a disk tier below, a complete chunk evicted from host memory is first **spilled**: its
host slot is written to a disk slot (read meanwhile, never reused), then given up; the chunk
lives on, on disk only, until a load **promotes** it into a host slot again (invisible to
other loads while it is read back). Disk slots are evicted least recently used first too, and
a chunk whose write or read fails is dropped, never served.

Room is made least recently used first, over every namespace at once: the tier's bytes, not
each namespace's, are what the daemon promised to stay within. When a reservation would take
host memory past its high watermark, chunks leave it until it fits under the low one, so
eviction runs in batches, not at every store (:meth:`TierIndex.make_room`, called before
:meth:`TierIndex.reserve`).

Memory: a slot freed by eviction keeps its pages (committed) and is the first its namespace
reuses, so a namespace that churns does not fault its pages in again. Committed slots, held or
free, never exceed the limit: a slot that needs new pages first has other free slots' pages
given back (:meth:`TierIndex.take_released` says which; the owner releases them before any copy).

>>> index = TierIndex(limit_bytes=4096, high=1.0, low=0.5)
>>> ns = index.namespace("llama", chunk_bytes=1024, all_heads=0b1)
>>> [c.slot for c in index.reserve(ns, [b"a", b"b", b"c", b"d"], 0b1)]
[0, 1, 2, 3]
>>> index.finish(ns, [b"a", b"b", b"c", b"d"], 0b1)
>>> index.lookup(ns, [b"a", b"b", b"x"])
2
>>> index.make_room(ns, 1)  # past the high watermark: down to the low one (no disk: dropped)
[]
>>> [k for k in (b"a", b"b", b"c", b"d") if index.get(ns, k)]  # least recently used went first
[b'b']
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Chunk", "Namespace", "TierIndex"]


@dataclass
class Chunk:
    namespace: Namespace
    key: bytes
    #: Its host slot (None: on disk only).
    slot: int | None
    #: Heads written so far (bit h: global KV head h), of :attr:`Namespace.all_heads`.
    heads: int = 0
    #: Stores copying into it now.
    writing: int = 0
    #: Loads copying out of it now.
    pins: int = 0
    #: Its disk slot, once written there.
    disk: int | None = None
    #: Its host slot is being written to disk.
    spilling: bool = False
    #: Its host slot is being read back from disk.
    promoting: bool = False
    #: The checksum of its bytes as written to disk (set by the owner).
    disk_sum: int = 0

    @property
    def complete(self) -> bool:
        return self.heads == self.namespace.all_heads and not self.writing

    @property
    def evictable(self) -> bool:
        return not (self.writing or self.pins or self.spilling or self.promoting)


@dataclass
class Namespace:
    name: str
    chunk_bytes: int
    all_heads: int
    #: Free host slots whose pages are still committed, lowest first (reused first).
    free: list[int] = field(default_factory=list)
    #: Free host slots whose pages were given back.
    released: list[int] = field(default_factory=list)
    #: Host slots ever handed out (the next new one).
    made: int = 0
    disk_free: list[int] = field(default_factory=list)
    disk_made: int = 0
    #: Chunks held in host memory, and on disk only.
    chunks: int = 0
    disk_chunks: int = 0
    hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    evictions: int = 0
    disk_evictions: int = 0
    #: Chunks dropped because their disk write or read failed (or read back other bytes).
    disk_failures: int = 0


class TierIndex:
    def __init__(
        self,
        limit_bytes: int,
        high: float = 1.0,
        low: float = 0.9,
        disk_limit_bytes: int = 0,
        on_change: Callable[[str, Namespace, bytes], None] = lambda what, ns, key: None,
    ) -> None:
        if not 0 < low <= high <= 1:
            raise ValueError("tier watermarks: need 0 < low <= high <= 1")
        self.limit_bytes = limit_bytes
        self.high_bytes, self.low_bytes = int(limit_bytes * high), int(limit_bytes * low)
        self.disk_limit_bytes = disk_limit_bytes
        self.used_bytes = 0
        #: Bytes of host slots whose pages are committed: held ones and free ones not given back.
        self.committed_bytes = 0
        self.disk_used_bytes = 0
        self.namespaces: dict[str, Namespace] = {}
        self._all: dict[tuple[str, bytes], Chunk] = {}
        #: Chunks with a host slot, and with a disk slot, least recently used first.
        self._host: OrderedDict[tuple[str, bytes], Chunk] = OrderedDict()
        self._disk: OrderedDict[tuple[str, bytes], Chunk] = OrderedDict()
        #: Free host slots whose pages are to be given back, since the owner last took them.
        self.released: list[tuple[Namespace, int]] = []
        #: Hears ``("stored", ns, key)`` when a chunk became complete, ``("removed", ...)``
        #: when a complete chunk left the node.
        self._on_change = on_change

    @property
    def has_disk(self) -> bool:
        return self.disk_limit_bytes > 0

    def namespace(self, name: str, chunk_bytes: int, all_heads: int) -> Namespace:
        ns = self.namespaces.get(name)
        if ns is None:
            ns = self.namespaces[name] = Namespace(name, chunk_bytes, all_heads)
        return ns

    def get(self, ns: Namespace, key: bytes) -> Chunk | None:
        return self._all.get((ns.name, key))

    def lookup(self, ns: Namespace, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, are complete chunks (each one counts as used)."""
        hits = 0
        for key in keys:
            chunk = self._all.get((ns.name, key))
            if chunk is None or not chunk.complete:
                break
            self._touch(chunk)
            hits += 1
            if chunk.slot is None:
                ns.disk_hits += 1
        ns.hits += hits
        ns.misses += len(keys) - hits
        return hits

    def make_room(self, ns: Namespace, count: int) -> list[Chunk]:
        """Before a reservation of ``count`` chunks: if it would take host memory past the high
        watermark, chunks leave it, least recently used first, until it would fit under the
        low one. Without a disk tier they are dropped; with one, those on disk already give
        their host slot up at once and the others are returned, marked spilling, for the
        owner to write (then :meth:`spilled`)."""
        need = count * ns.chunk_bytes
        if self.used_bytes + need <= self.high_bytes:
            return []
        leaving = 0
        spills: list[Chunk] = []
        for chunk in list(self._host.values()):
            if self.used_bytes - leaving + need <= self.low_bytes:
                break
            if not chunk.evictable:
                continue
            chunk.namespace.evictions += 1
            if not self.has_disk or not chunk.complete:
                self._drop(chunk)
            elif chunk.disk is not None:
                self._leave_host(chunk)
            else:
                chunk.spilling = True
                leaving += chunk.namespace.chunk_bytes
                spills.append(chunk)
        return spills

    def disk_slot(self, chunk: Chunk) -> int | None:
        """A disk slot for a spilling chunk, after evicting disk-only chunks least recently
        used first as needed; None when there is no room."""
        ns = chunk.namespace
        if self.disk_used_bytes + ns.chunk_bytes > self.disk_limit_bytes:
            for other in list(self._disk.values()):
                if self.disk_used_bytes + ns.chunk_bytes <= self.disk_limit_bytes:
                    break
                if other.pins or other.promoting or other.spilling:
                    continue
                other.namespace.disk_evictions += 1
                if other.slot is None:
                    self._drop(other)
                else:
                    self._leave_disk(other)
        if self.disk_used_bytes + ns.chunk_bytes > self.disk_limit_bytes:
            return None
        self.disk_used_bytes += ns.chunk_bytes
        if ns.disk_free:
            slot = heapq.heappop(ns.disk_free)
        else:
            slot, ns.disk_made = ns.disk_made, ns.disk_made + 1
        chunk.disk = slot
        self._disk[(ns.name, chunk.key)] = chunk
        return slot

    def spilled(self, chunk: Chunk, ok: bool, failed: bool = True) -> None:
        """A spill ended: written (``ok``: the host slot is given up, unless a load pinned the
        chunk meanwhile) or not (the chunk is dropped; counted as a disk failure when the write
        ``failed``, not when the disk had no room)."""
        chunk.spilling = False
        if not ok:
            chunk.namespace.disk_failures += failed
            self._drop(chunk)
        elif not chunk.pins and chunk.slot is not None:
            self._leave_host(chunk)

    def reserve(self, ns: Namespace, keys: list[bytes], heads: int) -> list[Chunk]:
        """Chunks for a store of ``heads`` under ``keys``, marked writing: a new chunk per new
        key, the partial chunk of a key whose other heads are in. Keys already holding these
        heads, or being written, are left out; so is every key from the first that finds no
        room (a prefix is what lookups can use). Call :meth:`make_room` first."""
        out: list[Chunk] = []
        for key in keys:
            chunk = self._all.get((ns.name, key))
            if chunk is not None:
                if chunk.writing or chunk.heads & heads == heads or chunk.slot is None:
                    continue  # a complete chunk on disk holds every head
                self._touch(chunk)
            else:
                slot = self._slot(ns)
                if slot is None:
                    break
                chunk = Chunk(ns, key, slot)
                self._all[(ns.name, key)] = self._host[(ns.name, key)] = chunk
                ns.chunks += 1
            chunk.writing += 1
            out.append(chunk)
        return out

    def finish(self, ns: Namespace, keys: list[bytes], heads: int, ok: bool = True) -> None:
        """A store of ``heads`` into these keys' reserved chunks ended (``ok``: every byte is
        in); a failed one leaves its chunks out (dropped, unless other heads are in)."""
        for key in keys:
            chunk = self._all.get((ns.name, key))
            if chunk is None or not chunk.writing:
                continue
            chunk.writing -= 1
            if ok:
                was = chunk.heads == ns.all_heads
                chunk.heads |= heads
                if chunk.complete and not was:
                    self._on_change("stored", ns, key)
            elif not chunk.heads:
                self._drop(chunk)

    def promote(self, chunk: Chunk) -> int | None:
        """A host slot for a disk-only chunk a load is about to read back (marked promoting);
        None when there is no room (call :meth:`make_room` first)."""
        slot = self._slot(chunk.namespace)
        if slot is None:
            return None
        ns = chunk.namespace
        chunk.slot, chunk.promoting = slot, True
        self._host[(ns.name, chunk.key)] = chunk
        ns.chunks, ns.disk_chunks = ns.chunks + 1, ns.disk_chunks - 1
        return slot

    def promoted(self, chunk: Chunk, ok: bool) -> None:
        """A read back ended: the chunk is in host memory again, or (``ok`` false: the read
        failed or brought other bytes) dropped."""
        chunk.promoting = False
        if not ok:
            chunk.namespace.disk_failures += 1
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

    # -- slots ----------------------------------------------------------------------------

    def _slot(self, ns: Namespace) -> int | None:
        """A free host slot of ``ns``; None when the tier holds its limit."""
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

    def _touch(self, chunk: Chunk) -> None:
        key = (chunk.namespace.name, chunk.key)
        if chunk.slot is not None:
            self._host.move_to_end(key)
        if chunk.disk is not None:
            self._disk.move_to_end(key)

    def _leave_host(self, chunk: Chunk) -> None:
        """The chunk stays on disk only."""
        ns = chunk.namespace
        assert chunk.slot is not None
        del self._host[(ns.name, chunk.key)]
        heapq.heappush(ns.free, chunk.slot)
        chunk.slot = None
        self.used_bytes -= ns.chunk_bytes
        ns.chunks, ns.disk_chunks = ns.chunks - 1, ns.disk_chunks + 1

    def _leave_disk(self, chunk: Chunk) -> None:
        ns = chunk.namespace
        assert chunk.disk is not None
        del self._disk[(ns.name, chunk.key)]
        heapq.heappush(ns.disk_free, chunk.disk)
        chunk.disk = None
        self.disk_used_bytes -= ns.chunk_bytes

    def _drop(self, chunk: Chunk) -> None:
        ns = chunk.namespace
        del self._all[(ns.name, chunk.key)]
        if chunk.heads == ns.all_heads:
            self._on_change("removed", ns, chunk.key)
        if chunk.disk is not None:
            self._leave_disk(chunk)
        if chunk.slot is not None:
            del self._host[(ns.name, chunk.key)]
            heapq.heappush(ns.free, chunk.slot)
            self.used_bytes -= ns.chunk_bytes
            ns.chunks -= 1
        else:
            ns.disk_chunks -= 1
