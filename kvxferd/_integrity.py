"""Block integrity: what an offer held when it was written, checked where its blocks land.

Three checks with the sums of :mod:`..dataplane.checksum`, over what the ``integrity``
setting covers: every byte of every offered block (``full``), or ``integrity_samples``
random segments, one block's K or V of one layer each (``sampled``, the default: a reused
block, a stale block reference or a broken path changes every segment it touches, so a few
catch it at the cost of a few segments; a lone flipped bit needs ``full``).

1. **Digest**: the moment an offer is written (in the offer call, or in the layers-ready call
   that completes a layer-wise offer), the offering daemon sums what it covers. A digest over
   more than :data:`INLINE_BYTES` is summed off the event loop right after, and the offer
   answers at once (a block rewritten within that window is not caught as rewritten).
2. **At the source** (sampled), once the bytes left and before ``sent``: the same again. A
   block that changed since the offer (its engine reused it before the pull ended) fails the
   transfer with :class:`DataLossError` naming it, rather than ship new contents under the old
   request. In ``full`` mode this pass is left out: step 3 compares every landed byte with
   the digest, so a block changed at the source fails there (a third full pass would only
   say where it changed).
3. **Where they land**, before ``done``: the receiver sums what arrived and compares it with
   the digest (carried in ``sent``; at hand on a local pull). A mismatch fails the pull with
   :class:`DataLossError` naming the blocks; the destination is never reported filled.

A remapped stream (other TP, head order or block size) lands in blocks cut otherwise than
the offer's: after step 2 (both modes), the source also sums the stream as it left, by windows
of its bytes (all of them, :data:`FULL_WINDOW` each, in ``full``; ``integrity_samples``
random windows of :data:`SAMPLE_WINDOW` in ``sampled``), and the receiver sums the same windows
of what landed (each side through its own plan of the stream).

Not checked, and said so in the transfer's record: GPU pools (no checksum kernel yet), offers
of a daemon with ``integrity: off``.

>>> digest = Digest("sampled", np.array([1, 4]), np.array([0, 3]), np.array([7, 9], dtype=np.uint64))
>>> offer_pos, stream_pos, regions, sums = digest.for_pull(np.array([4, 2, 1]))  # a pull of 4, 2, 1
>>> stream_pos.tolist(), regions.tolist(), sums.tolist()
([2, 0], [0, 3], [7, 9])
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import DataLossError, InvalidRequestError, KvxferError
from kvxfer.proto import peer_pb2

from ._config import Settings
from ._faults import Faults
from ._log import log_event
from ._offers import Offer
from ._transfers import TransferRecord
from .dataplane.checksum import block_sums, segment_sums, window_sums
from .dataplane.hostmem import HostMemory
from .dataplane.plan import RegionTable, SidePlan, build_plan, num_chunks, window_pieces
from .memory.pools import Pool

__all__ = ["FULL_WINDOW", "INLINE_BYTES", "SAMPLE_WINDOW", "Digest", "Integrity"]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
#: Sums over at most this many bytes run on the event loop (about 0.2 ms here); more go to
#: the copy threads.
INLINE_BYTES = 1 << 20
#: Blocks named in an error message (a mismatch of many says how many more).
NAMED = 8
#: Windows of a remapped stream, summed whole in ``full`` mode and sampled in ``sampled`` mode
#: (a sample about one segment of a Llama-8B-sized block); a peer's windows must lie between.
FULL_WINDOW, SAMPLE_WINDOW = 8 << 20, 64 << 10
MIN_WINDOW, MAX_WINDOW = 8, 64 << 20


@dataclass(frozen=True)
class Digest:
    """An offer's sums when it was written: entries at ``positions`` of its block list, of
    region ``regions[j]`` (sampled) or of the whole block (``regions`` None)."""

    mode: str
    positions: I64
    regions: I64 | None
    sums: U64

    def for_pull(self, indices: I64 | None) -> tuple[I64, I64, I64 | None, U64]:
        """The entries a pull of the offer's blocks at ``indices`` (None: all) moves: their
        offer positions, positions in the pull's stream, regions, sums."""
        if indices is None:
            return self.positions, self.positions, self.regions, self.sums
        order = np.argsort(indices, kind="stable")
        at = np.minimum(np.searchsorted(indices, self.positions, sorter=order), len(indices) - 1)
        stream = order[at]
        moved = indices[stream] == self.positions
        regions = self.regions[moved] if self.regions is not None else None
        return self.positions[moved], stream[moved], regions, self.sums[moved]


class Integrity:
    """The daemon's checks (see the module docstring); ``count`` hears of each one."""

    def __init__(
        self,
        settings: Settings,
        executor: Executor,
        faults: Faults,
        count: Callable[[str, str, int], None] = lambda mode, result, blocks: None,
    ) -> None:
        self.mode = settings.integrity
        self.samples = settings.integrity_samples
        self.executor = executor
        self.faults = faults
        self._count = count

    # -- the offering side ----------------------------------------------------------------

    def take_digest(self, offer: Offer) -> None:
        """Sum the offer's blocks if it is written and not summed yet (called when it is made,
        and when a layer-wise offer's layers are said written)."""
        if offer.digest is not None or offer.integrity_off:
            return
        if self.mode == "off":
            offer.integrity_off = "integrity is off on the offering daemon"
            return
        if offer.pool.on_gpu:
            offer.integrity_off = "GPU pool: no checksum kernel yet"
            return
        if not offer.written:
            return
        n, nbytes = len(offer.block_ids), offer.pool.regions.nbytes
        regions: I64 | None = None
        if self.mode == "full":
            positions = np.arange(n, dtype=np.int64)
        else:
            rng = np.random.default_rng(secrets.randbits(64))
            picks = np.sort(rng.choice(n * len(nbytes), min(self.samples, n * len(nbytes)), replace=False))
            positions, regions = (picks // len(nbytes)).astype(np.int64), (picks % len(nbytes)).astype(np.int64)
        future: asyncio.Future[Digest | None] = asyncio.get_running_loop().create_future()
        offer.digest = future

        def summed(sums: U64 | None) -> Digest | None:
            if sums is None:
                offer.integrity_off = "the offered pool went away before its blocks were summed"
                return None
            log_event("integrity.digest", logging.DEBUG, offer_id=offer.offer_id, mode=self.mode, sums=len(sums))
            return Digest(self.mode, positions, regions, sums)

        if _covered(offer.pool, positions, regions) <= INLINE_BYTES:
            try:
                memory = offer.pool.host_memory()
                future.set_result(summed(_sum_in(memory, offer.pool.regions, offer.block_ids[positions], regions)))
            except KvxferError as exc:  # e.g. an engine's process memory that cannot be read
                offer.integrity_off = f"its blocks could not be summed: {exc}"
                offer.digest = None
            return
        task = asyncio.ensure_future(self._sums(offer.pool, offer.block_ids[positions], regions))
        task.add_done_callback(lambda t: _settle(future, t, summed))

    async def to_send(
        self, record: TransferRecord, offer: Offer, indices: I64 | None, remapped: SidePlan | None
    ) -> peer_pb2.BlockSums | None:
        """At the source, once the bytes left: the sums a pull of ``indices`` (None: all) is
        checked against where it lands, after checking those blocks did not change since the
        offer (DataLossError naming them if they did). ``remapped``: this side's plan of a
        remapped stream, whose windows are summed instead (before the blocks are checked, so a
        block changed in between fails that check)."""
        digest = await self._digest_of(offer)
        if digest is None:
            why = offer.integrity_off or "no digest was taken"
            self._unchecked(record, why)
            return peer_pb2.BlockSums(unchecked=why)  # the receiver's record says why
        left: U64 | None = None
        if remapped is not None:
            window, picks = self._windows(digest.mode, remapped.total_bytes)
            left = await self._window_sums(offer.pool, remapped, window, picks)
            if left is None:
                self._unchecked(record, "the offered pool went away")
                return None
        offer_pos, stream_pos, regions, sums = digest.for_pull(indices)
        blocks = len(np.unique(offer_pos))
        if digest.mode == "full" and remapped is None:
            # Every byte is checked where it lands, against the digest: a block changed here
            # shows there. Reading them all again here would be a third pass over the request.
            record.integrity_mode, record.integrity_blocks, record.integrity_result = "full", blocks, "sent"
            changed = np.zeros(0, dtype=bool)
        else:
            now = await self._sums(offer.pool, offer.block_ids[offer_pos], regions)
            if now is None:
                self._unchecked(record, "the offered pool went away")
                return None
            changed = now != sums
            self._checked(record, digest.mode, blocks, bool(changed.any()))
        if changed.any():
            raise DataLossError(
                f"offer {offer.offer_id}: blocks {_named(np.unique(offer.block_ids[offer_pos[changed]]))} changed "
                "after they were offered (the engine wrote them again before the pull ended): not sent",
                offer_id=offer.offer_id,
                transfer_id=record.transfer_id,
            )
        if left is not None:
            return peer_pb2.BlockSums(mode=digest.mode, window_bytes=window, windows=picks.tolist(), sums=left.tolist())
        return peer_pb2.BlockSums(
            mode=digest.mode,
            positions=stream_pos.tolist(),
            sums=sums.tolist(),
            regions=regions.tolist() if regions is not None else [],
        )

    async def _digest_of(self, offer: Offer) -> Digest | None:
        if offer.digest is None:
            return None
        try:
            digest: Digest | None = await asyncio.shield(offer.digest)
        except KvxferError as exc:  # e.g. the engine's process memory became unreadable
            offer.integrity_off = f"its blocks could not be summed: {exc}"
            return None
        return digest

    # -- where the blocks land ------------------------------------------------------------

    async def check_landed(
        self,
        record: TransferRecord,
        sums: peer_pb2.BlockSums | None,
        dst: Pool,
        dst_ids: I64,
        remapped: SidePlan | None = None,
    ) -> None:
        """Before done: the landed blocks' sums against ``sums`` (the offering daemon's);
        ``remapped``: this side's plan of a remapped stream (its windows are compared)."""
        if not dst.on_gpu and self.faults.corrupts("before_check", record.transfer_id):
            _flip_first_bit(dst, dst_ids)
        windowed = sums is not None and sums.window_bytes > 0
        if sums is not None and len(sums.sums) and windowed != (remapped is not None):
            raise InvalidRequestError("the peer's sums do not fit this stream (windows of a remap, blocks otherwise)")
        if windowed and remapped is not None and sums is not None:
            await self._check_windows(record, sums, dst, dst_ids, remapped)
            return
        if sums is None or not len(sums.positions):
            why = f" ({sums.unchecked[:200]})" if sums is not None and sums.unchecked else ""
            self._unchecked(record, record.integrity_result or f"no sums from the offering daemon{why}")
            return
        if dst.on_gpu:
            self._unchecked(record, "GPU destination: no checksum kernel yet")
            return
        positions = np.asarray(sums.positions, dtype=np.int64)
        expected = np.asarray(sums.sums, dtype=np.uint64)
        regions = np.asarray(sums.regions, dtype=np.int64) if len(sums.regions) else None
        if (
            len(positions) != len(expected)
            or positions.max() >= len(dst_ids)
            or (regions is not None and (len(regions) != len(positions) or regions.max() >= len(dst.regions.nbytes)))
        ):
            raise InvalidRequestError("the peer's block sums name blocks or regions outside this transfer")
        landed = await self._sums(dst, dst_ids[positions], regions)
        if landed is None:
            self._unchecked(record, "the destination pool went away")
            return
        bad = landed != expected
        self._checked(record, sums.mode, len(np.unique(positions)), bool(bad.any()))
        if bad.any():
            raise DataLossError(
                f"blocks {_named(np.unique(dst_ids[positions[bad]]))} (positions {_named(np.unique(positions[bad]))} "
                f"of the transfer) landed with other bytes than offer {record.offer_id} held when it was written: "
                "changed at the source or corrupted on the way; the destination is not filled",
                transfer_id=record.transfer_id,
                offer_id=record.offer_id,
            )

    async def _check_windows(
        self, record: TransferRecord, sums: peer_pb2.BlockSums, dst: Pool, dst_ids: I64, plan: SidePlan
    ) -> None:
        window, count = sums.window_bytes, num_chunks(plan.total_bytes, max(1, sums.window_bytes))
        if (
            not MIN_WINDOW <= window <= MAX_WINDOW
            or not sums.windows
            or len(sums.windows) != len(sums.sums)
            or len(sums.windows) > count
            or max(sums.windows) >= count
        ):
            raise InvalidRequestError("the peer's window sums name windows outside this stream")
        picks = np.asarray(sums.windows, dtype=np.int64)
        landed = await self._window_sums(dst, plan, window, picks)
        if landed is None:
            self._unchecked(record, "the destination pool went away")
            return
        bad = landed != np.asarray(sums.sums, dtype=np.uint64)
        blocks = len(dst_ids) if sums.mode == "full" else len(_blocks_under(dst, plan, window, picks))
        self._checked(record, sums.mode, blocks, bool(bad.any()))
        if bad.any():
            raise DataLossError(
                f"blocks {_named(_blocks_under(dst, plan, window, picks[bad]))} (bytes "
                f"{_named(picks[bad] * window)} onwards, {window} each, of the remapped stream) landed with "
                f"other bytes than offer {record.offer_id} sent: corrupted on the way; the destination is not filled",
                transfer_id=record.transfer_id,
                offer_id=record.offer_id,
            )

    def _windows(self, mode: str, total_bytes: int) -> tuple[int, I64]:
        """The windows of a remapped stream to sum: all, or a random sample."""
        window = FULL_WINDOW if mode == "full" else SAMPLE_WINDOW
        count = num_chunks(total_bytes, window)
        if mode == "full":
            return window, np.arange(count, dtype=np.int64)
        rng = np.random.default_rng(secrets.randbits(64))
        return window, np.sort(rng.choice(count, min(self.samples, count), replace=False)).astype(np.int64)

    async def _window_sums(self, pool: Pool, plan: SidePlan, window: int, picks: I64) -> U64 | None:
        return await self._summed(pool, len(picks) * window, window_sums, plan, window, picks)

    # -- shared ---------------------------------------------------------------------------

    async def _sums(self, pool: Pool, ids: I64, regions: I64 | None) -> U64 | None:
        return await self._summed(pool, _covered(pool, ids, regions), _sum_in, pool.regions, ids, regions)

    async def _summed(self, pool: Pool, nbytes: int, sums: Callable[..., U64], *args: Any) -> U64 | None:
        """``sums(pool's host memory, *args)`` over ``nbytes``: on the loop when small, else in a
        copy thread; None when the pool is going away."""
        if pool.closing:
            return None
        with pool.in_use():
            memory = pool.host_memory()
            if nbytes <= INLINE_BYTES:
                return sums(memory, *args)
            loop = asyncio.get_running_loop()
            result: U64 = await loop.run_in_executor(self.executor, sums, memory, *args)
            return result

    def _checked(self, record: TransferRecord, mode: str, blocks: int, mismatch: bool) -> None:
        record.integrity_mode, record.integrity_blocks = mode, blocks
        record.integrity_result = "mismatch" if mismatch else "ok"
        self._count(mode, record.integrity_result, blocks)

    def _unchecked(self, record: TransferRecord, why: str) -> None:
        record.integrity_result = why if why.startswith("not checked") else f"not checked: {why}"
        self._count(record.integrity_mode, "not_checked", 0)


def _sum_in(memory: HostMemory, table: RegionTable, ids: I64, regions: I64 | None) -> U64:
    """Whole blocks' sums (``regions`` None), or one region's segment of each block."""
    if regions is None:
        return block_sums(memory, table, ids)
    return segment_sums(memory, table, ids, regions)


def _covered(pool: Pool, ids: I64, regions: I64 | None) -> int:
    """Bytes the sums of these entries read."""
    if regions is None:
        return len(ids) * int(pool.regions.nbytes.sum())
    return int(pool.regions.nbytes[regions].sum())


def _settle(future: asyncio.Future[Any], task: asyncio.Future[Any], summed: Callable[[Any], Any]) -> None:
    """Hand a digest summed in a copy thread to the offer's future (its error, if any)."""
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())  # type: ignore[arg-type]
        future.exception()  # retrieved: an offer gone before its pull logs no warning
    else:
        future.set_result(summed(task.result()))


def _blocks_under(pool: Pool, plan: SidePlan, window: int, picks: I64) -> I64:
    """The pool's blocks that hold bytes of these windows of ``plan``'s stream."""
    found = [np.zeros(0, dtype=np.int64)]
    regions = pool.regions
    for w in picks.tolist():
        buf, off, _ = window_pieces(plan, w * window, min((w + 1) * window, plan.total_bytes))
        rel = off[:, None] - regions.offset[None, :]
        block = rel // np.maximum(regions.stride, 1)[None, :]
        inside = (buf[:, None] == regions.buffer[None, :]) & (rel >= 0)
        inside &= (rel - block * regions.stride[None, :] < regions.nbytes[None, :]) & (block < pool.layout.num_blocks)
        found.append(block[inside])
    return np.unique(np.concatenate(found))


def _flip_first_bit(dst: Pool, dst_ids: I64) -> None:
    """Fault injection (``before_check=corrupt``): flip one bit of the first landed block, as a
    fault on the way would."""
    regions = dst.regions
    first = RegionTable(regions.buffer[:1], regions.offset[:1], regions.stride[:1], np.ones(1, np.int64))
    chunk = build_plan(first, dst_ids[:1], 1).chunks[0]
    memory, byte = dst.host_memory(), np.zeros(1, dtype=np.uint8)
    memory.gather(chunk, byte)
    byte ^= 1
    memory.scatter(chunk, byte)


def _named(values: Any) -> str:
    """Up to :data:`NAMED` values, and how many more."""
    listed = [int(v) for v in values]
    more = f" and {len(listed) - NAMED} more" if len(listed) > NAMED else ""
    return f"{listed[:NAMED]}{more}"
