"""The host tier: KV blocks kept in the daemon's own memory, by key, for any engine of the node.

An engine stores blocks under keys it computes (a chained hash of each block's tokens and its
predecessor's key), looks up how long a prefix of keys is stored, and loads those blocks back
into its pool, perhaps another engine's pool, perhaps after the storing engine has exited.
What the daemon stores is the block's KV in a **canonical layout** that does not depend on the
storing engine's tensor parallelism or head order: every layer's K and V, each with every KV
head, heads-major (``HND``), all regions of a chunk back to back. A rank of a TP engine stores
its heads into the chunk (the remap planner of :mod:`..dataplane.remap` places them), and
the chunk becomes visible once every head is in; a load takes the heads the loading pool
holds. Pools that declare no :class:`~kvxfer_client.KvGeometry` store their blocks as they
are, in a namespace of their own layout.

**Namespaces** keep unrelated KV apart: the model, dtype, tokens per block, KV heads, head
bytes, layers, in-block format (``kv_format``) and the engine's ``salt`` (e.g. one per tenant)
are hashed into the namespace of a pool's keys. Two engines share chunks exactly when all of
those agree; nothing an engine sends names memory.

**Memory**: one anonymous mapping per namespace, reserved (not committed) at the tier's
limit, cut into page-aligned slots; the index (:mod:`.index`) keeps the bytes of all slots
in use within ``tier_host_bytes``, evicts least recently used chunks past the high
watermark, and keeps the committed pages (slots held, or free and not given back) within the
limit too: another namespace's free slots go back to the kernel (``MADV_DONTNEED``) before a
slot needs new pages. The daemon's resident memory for the tier stays within the limit.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.errors import IncompatibleError, InvalidRequestError, KvxferError, NotFoundError
from kvxfer.geometry import KvGeometry, rank_heads
from kvxfer.layout import Layout, Region

from .._log import log_event
from .._services import Services
from ..dataplane.remap import remap_plans
from ..handoff.local import LocalHandoff
from ..memory.pools import Pool, mapped_pool
from .chunks import canonical, check_keys, namespace_name
from .disk import DiskStore
from .events import TierEvents
from .index import Chunk, Namespace, TierIndex
from .views import TierView

__all__ = ["HostTier", "TierNamespace"]

I64 = npt.NDArray[np.int64]
#: Namespaces one daemon keeps at once (each reserves address space, not memory).
MAX_NAMESPACES = 64
_PAGE = mmap.PAGESIZE


@dataclass
class TierNamespace:
    """A namespace's memory, and its chunks' layout as a pool of slots the copy code moves."""

    ns: Namespace
    label: str
    #: Its slots as a pool (its layout's geometry: None when blocks are kept as their pool
    #: lays them out).
    view: Pool
    memory: mmap.mmap
    array: npt.NDArray[np.uint8]

    def slot_bytes(self, slot: int) -> npt.NDArray[np.uint8]:
        stride = self.ns.chunk_bytes
        return self.array[slot * stride : (slot + 1) * stride]


class HostTier:
    def __init__(
        self,
        services: Services,
        local: LocalHandoff,
        count: Callable[[str, int, int, float], None] = lambda op, blocks, nbytes, seconds: None,
        disk: DiskStore | None = None,
    ) -> None:
        """The tier's sizes come from the settings (``tier_host_bytes``, its watermarks,
        ``tier_disk_bytes`` when there is a ``disk``); ``count`` hears of every copy."""
        s = services.settings
        disk_limit = s.tier_disk_bytes if disk is not None else 0
        #: Keys stored and removed, for routers (``AdminService.WatchTier``).
        self.events = TierEvents()
        self.index = TierIndex(
            s.tier_host_bytes, s.tier_high_watermark, s.tier_low_watermark, disk_limit, self._changed
        )
        self.local = local
        self.disk = disk
        self.executor: Executor = services.executor
        self.faults = services.faults
        self._count = count
        self._spaces: dict[str, TierNamespace] = {}

    # -- the three calls ------------------------------------------------------------------

    async def store(self, pool: Pool, ids: I64, keys: list[bytes], salt: bytes) -> tuple[int, int]:
        """Copy blocks ``ids`` of ``pool`` into the tier under ``keys`` (one per block). Returns
        (blocks copied, blocks left out: already there or no room). The blocks are free for
        the engine once this returns."""
        check_keys(keys, salt, len(ids))
        space, heads = self._space(pool, salt, create=True)
        assert space is not None
        started = time.perf_counter()
        await self._make_room(space.ns, len(keys))
        reserved = self.index.reserve(space.ns, keys, heads)
        self._release()  # before anything is copied into a slot that was given back
        if not reserved:
            return 0, len(keys)
        where = {key: i for i, key in enumerate(keys)}
        src_ids = ids[[where[c.key] for c in reserved]]
        ok = False
        try:
            await self._copy(pool, src_ids, space.view, _slots(reserved))
            ok = True
        finally:
            self.index.finish(space.ns, [c.key for c in reserved], heads, ok)
            self._release()
        nbytes = len(reserved) * pool.layout.bytes_per_block
        self._count("store", len(reserved), nbytes, time.perf_counter() - started)
        return len(reserved), len(keys) - len(reserved)

    def lookup(self, pool: Pool | Layout, keys: list[bytes], salt: bytes) -> int:
        """How many of ``keys``, from the first, the tier holds for the namespace of ``pool``
        (or of the layout a peer described for its pool). Never makes one."""
        check_keys(keys, salt, len(keys))
        space, _ = self._space(pool, salt, create=False)
        return 0 if space is None else self.index.lookup(space.ns, keys)

    async def load(self, pool: Pool, ids: I64, keys: list[bytes], salt: bytes) -> int:
        """Copy the chunks of the longest stored prefix of ``keys`` into blocks ``ids`` of
        ``pool`` (``ids[j]`` takes ``keys[j]``); returns how many were loaded (the engine
        computes the rest). A loaded chunk cannot be evicted while it is copied out."""
        check_keys(keys, salt, len(ids))
        started = time.perf_counter()
        view, slots, unpin = await self.hold(pool, keys, salt, prefix=True)
        if view is None:
            return 0
        try:
            await self._copy(view, slots, pool, ids[: len(slots)])
        finally:
            unpin()
        nbytes = len(slots) * pool.layout.bytes_per_block
        self._count("load", len(slots), nbytes, time.perf_counter() - started)
        return len(slots)

    async def hold(
        self, pool: Pool | Layout, keys: list[bytes], salt: bytes, prefix: bool = False
    ) -> tuple[Pool | None, I64, Callable[[], None]]:
        """The chunks stored under ``keys`` (every one, or with ``prefix`` the longest stored
        prefix of them; read back from disk where needed), pinned until the returned callable
        is called: the tier's memory and slots, to be offered like a pool's blocks.
        NotFoundError when not all of them are stored (without ``prefix``)."""
        check_keys(keys, salt, len(keys))
        space, _ = self._space(pool, salt, create=False)
        held = self._stored_prefix(space.ns, keys) if space is not None else []
        if not prefix and (space is None or len(held) != len(keys)):
            raise NotFoundError(
                f"{len(held)} of the {len(keys)} keys are stored in this pool's namespace: store them first"
            )
        if space is None or not held:
            return None, np.zeros(0, dtype=np.int64), lambda: None
        self.index.lookup(space.ns, [c.key for c in held])
        self.index.pin(held)
        try:
            on_disk = [c for c in held if c.slot is None]
            back = await self._promote(space, on_disk) if on_disk else 0
            if back < len(on_disk):
                if not prefix:
                    raise NotFoundError("chunks to offer could not be read back from the tier's disk")
                cut = held.index(on_disk[back])
                self.index.unpin(held[cut:])
                held = held[:cut]
                if not held:
                    return None, np.zeros(0, dtype=np.int64), lambda: None
        except BaseException:
            self.index.unpin(held)
            raise
        unpinned = False

        def unpin() -> None:
            nonlocal unpinned
            if not unpinned:
                unpinned = True
                self.index.unpin(held)

        return space.view, _slots(held), unpin

    def _stored_prefix(self, ns: Namespace, keys: list[bytes]) -> list[Chunk]:
        """The chunks of the longest prefix of ``keys`` that a load may read now."""
        held: list[Chunk] = []
        for key in keys:
            chunk = self.index.get(ns, key)
            if chunk is None or not chunk.complete or chunk.promoting:
                break
            held.append(chunk)
        return held

    def views(self) -> tuple[TierView, ...]:
        return tuple(
            TierView(
                namespace=name,
                label=s.label,
                chunks=s.ns.chunks,
                bytes=s.ns.chunks * s.ns.chunk_bytes,
                hits=s.ns.hits,
                misses=s.ns.misses,
                evictions=s.ns.evictions,
                disk_chunks=s.ns.disk_chunks,
                disk_bytes=s.ns.disk_chunks * s.ns.chunk_bytes,
                disk_hits=s.ns.disk_hits,
                disk_evictions=s.ns.disk_evictions,
                disk_failures=s.ns.disk_failures,
            )
            for name, s in self._spaces.items()
        )

    def _changed(self, what: str, ns: Namespace, key: bytes) -> None:
        (self.events.stored if what == "stored" else self.events.removed)(ns.name, key)

    def close(self) -> None:
        self.events.close()
        for space in self._spaces.values():
            space.view.close()
            del space.array
            try:
                space.memory.close()
            except BufferError:  # a copy thread still holds a view: the process is exiting anyway
                pass
        self._spaces.clear()
        if self.disk is not None:
            self.disk.close()

    # -- the disk below -------------------------------------------------------------------

    async def _make_room(self, ns: Namespace, count: int) -> None:
        """Room for ``count`` more chunks: evicted ones spilled to disk first (if there is one)."""
        spills = self.index.make_room(ns, count)
        for chunk in spills:
            await self._spill(chunk)

    async def _spill(self, chunk: Chunk) -> None:
        """Write an evicted chunk's host slot to disk, then let the slot go (or drop the chunk)."""
        assert self.disk is not None and chunk.slot is not None
        space = self._spaces[chunk.namespace.name]
        ok = failed = False
        try:
            await self.faults.hit("tier_disk_write")
            slot = self.index.disk_slot(chunk)
            if slot is not None:
                view = space.slot_bytes(chunk.slot)
                loop = asyncio.get_running_loop()
                chunk.disk_sum = await loop.run_in_executor(self.executor, self.disk.write, space.ns.name, slot, view)
                ok = True
        except (OSError, KvxferError) as exc:
            failed = True
            log_event("tier.disk_write_failed", logging.WARNING, namespace=space.ns.name, error=repr(exc))
        finally:
            self.index.spilled(chunk, ok, failed)

    async def _promote(self, space: TierNamespace, chunks: list[Chunk]) -> int:
        """Read disk-only chunks back into host slots (making room first); returns how many,
        from the first, came back whole."""
        assert self.disk is not None
        await self._make_room(space.ns, len(chunks))
        slots = []
        for chunk in chunks:
            slot = self.index.promote(chunk)
            if slot is None:
                break
            slots.append(slot)
        self._release()  # slots whose pages went back to the kernel for these
        disk, name = self.disk, space.ns.name
        places = []
        for chunk, slot in zip(chunks, slots, strict=False):
            assert chunk.disk is not None  # on disk only, or it would not be promoted
            places.append((chunk.disk, slot, chunk.disk_sum))

        def read_all() -> list[bool]:
            return [disk.read(name, d, space.slot_bytes(s), total) for d, s, total in places]

        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self.executor, read_all)
        back, whole = 0, True
        for chunk, ok in zip(chunks, results, strict=False):
            self.index.promoted(chunk, ok)
            whole = whole and ok
            back += whole
        return back

    # -- namespaces and memory ------------------------------------------------------------

    def _space(self, pool: Pool | Layout, salt: bytes, create: bool) -> tuple[TierNamespace | None, int]:
        """The namespace of the keys of a pool (or of a layout a peer described), made on the
        first store, and the heads the pool holds."""
        if isinstance(pool, Pool) and pool.on_gpu:
            raise IncompatibleError(
                "the host tier stores and loads host pools only (GPU pools: not built yet); stage GPU blocks "
                "through a host pool"
            )
        pool_layout = pool.layout if isinstance(pool, Pool) else pool
        layout = canonical(pool_layout)
        geometry = layout.geometry
        name, label = namespace_name(pool_layout, layout, salt)
        space = self._spaces.get(name)
        heads = 1
        if geometry is not None:
            model = pool_layout.model
            rank = rank_heads(geometry.total_kv_heads, max(1, model.tp_size), model.tp_rank)
            heads = ((1 << rank.count) - 1) << rank.first
        if space is None and create:
            space = self._make_space(name, label, layout)
        return space, heads

    def _make_space(self, name: str, label: str, layout: Layout) -> TierNamespace:
        if len(self._spaces) >= MAX_NAMESPACES:
            raise InvalidRequestError(f"the tier holds {MAX_NAMESPACES} namespaces already (models x salts)")
        stride = -(-layout.bytes_per_block // _PAGE) * _PAGE
        slots = self.index.limit_bytes // stride
        if slots < 1:
            raise InvalidRequestError(
                f"one block of this pool ({layout.bytes_per_block} bytes) is larger than the tier "
                f"({self.index.limit_bytes} bytes, tier_host_bytes)"
            )
        memory = mmap.mmap(-1, slots * stride, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        array = np.frombuffer(memory, dtype=np.uint8)  # page-aligned: slots suit O_DIRECT
        regions = tuple(Region(0, r.offset, stride, r.block_bytes) for r in layout.regions)
        view = mapped_pool(
            f"tier:{name}", f"tier {label}", Layout(slots, regions, layout.model, layout.geometry), [array]
        )
        ns = self.index.namespace(name, stride, _all_heads(layout.geometry))
        space = self._spaces[name] = TierNamespace(ns, label, view, memory, array)
        return space

    def _release(self) -> None:
        """Give the pages of the slots the index released back to the kernel."""
        for ns, slot in self.index.take_released():
            owner = self._spaces.get(ns.name)
            if owner is not None:
                owner.memory.madvise(mmap.MADV_DONTNEED, slot * ns.chunk_bytes, ns.chunk_bytes)

    async def _copy(self, src: Pool, src_ids: I64, dst: Pool, dst_ids: I64) -> None:
        """Between an engine's pool and a namespace's slots (either way)."""
        with src.in_use(), dst.in_use():
            plans = None
            if src.layout.geometry is not None:  # heads placed by the remap planner (off the loop)
                chunk = self.local.chunk_bytes
                plans = await asyncio.to_thread(remap_plans, src, src_ids, dst, dst_ids, chunk)
            await self.local.copy_blocks(src, src_ids, dst, dst_ids, plans)


def _all_heads(geometry: KvGeometry | None) -> int:
    return 1 if geometry is None else (1 << geometry.total_kv_heads) - 1


def _slots(chunks: list[Chunk]) -> I64:
    return np.array([c.slot for c in chunks], dtype=np.int64)
