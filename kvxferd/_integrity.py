"""Block integrity: what an offer held when it was written, checked where its blocks land.

Three checks with the sums of :mod:`..dataplane.checksum`, over what the ``integrity``
setting covers (:mod:`._digest`): every byte of every offered block (``full``), or
``integrity_samples`` windows of at most 64 KiB spread over the offer's bytes (``sampled``,
the default: a reused block, a stale block reference or a broken path changes every window
it touches, so a few catch it at the cost of a few windows, whatever the layout; a lone
flipped bit needs ``full``).

1. **Digest** (:mod:`._offer_digest`): once an offer is written, the offering daemon sums
   what it covers before the offer call answers (over :data:`._digest.INLINE_BYTES` of it
   in a copy thread meanwhile; a pull that comes sooner awaits the sums). A block of such a
   large offer rewritten before its sums are taken is not caught as rewritten.
2. **At the source, only when it tells something**: where the pull is not remapped, step 3
   compares what landed with the digest, so a block the engine wrote again before the pull
   ended fails there. Only then does the offering daemon sum its source again
   (``changed_since_offer``; on a remote pull the puller's ``done`` says the check failed),
   to fail the pull with :class:`DataLossError` "changed after they were offered" rather
   than "changed at the source or corrupted on the way". A remapped stream is checked by
   windows of its bytes, which cannot name blocks: there the blocks are summed again before
   ``sent``.
3. **Where they land**, before ``done``: the receiver sums what arrived and compares it with
   the digest (carried in ``sent``; at hand on a local pull). A mismatch fails the pull with
   :class:`DataLossError` naming the blocks; the destination is never reported filled. A
   local pull of a small offer whose digest holds every segment whole (a few segments, copied
   one assignment each) sums each segment right after it landed, while it is in cache, and
   compares the lists; only a mismatch takes the general check, which names the blocks.

A remapped stream (other TP, head order or block size) lands in blocks cut otherwise than
the offer's: after step 2 (both modes), the source also sums windows of the stream as it
left, and the receiver the same windows of what landed (:mod:`._stream_sums`).

Not checked, and said so in the transfer's record: GPU pools (no checksum kernel yet), offers
of a daemon with ``integrity: off``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from kvxfer.errors import DataLossError, InvalidRequestError, KvxferError
from kvxfer.proto import peer_pb2

from ._config import Settings
from ._cpu_time import cpu_timed
from ._digest import Digest, covered_bytes, peer_entries, pool_sums, sum_entries
from ._faults import Faults
from ._folded_sums import FoldedSums
from ._mismatch import changed_after_offer, distinct, flip_first_bit, landed_otherwise, stream_otherwise
from ._offer_digest import OfferDigests
from ._offers import Offer
from ._stream_sums import blocks_under, peer_windows, stream_windows
from ._transfers import TransferRecord
from ._whole_segments import digest_now, landed_as_offered, landed_as_said
from .dataplane.checksum import window_sums
from .dataplane.plan import SidePlan
from .memory.pools import Pool

__all__ = ["Integrity"]

T = TypeVar("T")
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


class Integrity:
    """The daemon's checks (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        executor: Executor,
        faults: Faults,
        count: Callable[[str, str, int], None] = lambda mode, result, blocks: None,
        spent: Callable[[str, float], None] = lambda step, seconds: None,
    ) -> None:
        """``count(mode, result, blocks)`` hears of each check, ``spent(step, seconds)`` of the
        time each step took (digest, source, landed)."""
        self.mode = settings.integrity
        self.samples = settings.integrity_samples
        self.executor = executor
        self.faults = faults
        self._count = count
        self._spent = spent
        # One generator for the daemon: where samples fall must not be foreseeable from outside,
        # and seeding one per offer costs more than the sums of a small offer.
        self._rng = np.random.default_rng(secrets.randbits(128))
        self.digests = OfferDigests(self.mode, self.samples, self._rng, self._sums, spent)

    # -- the offering side ----------------------------------------------------------------

    def take_digest(self, offer: Offer) -> None:
        """Sum the offer's blocks if it is written and not summed yet (called when it is made,
        and when a layer-wise offer's layers are said written): see :mod:`._offer_digest`."""
        self.digests.take(offer)

    async def to_send(
        self, record: TransferRecord, offer: Offer, indices: I64 | None, remapped: SidePlan | None
    ) -> peer_pb2.BlockSums | None:
        """At the source, once the bytes left: the sums a pull of ``indices`` (None: all) is
        checked against where it lands. ``remapped``: this side's plan of a remapped stream,
        whose windows are summed instead, and then the blocks checked unchanged since the offer
        (DataLossError naming them if they changed)."""
        started = time.thread_time()
        digest = digest_now(offer) if indices is None and remapped is None else None
        if digest is not None:  # a whole pull of a summed offer: its sums as sent, built once
            record.integrity_mode, record.integrity_result = digest.mode, "sent"
            record.integrity_blocks, sums = digest.sent_whole
            self._spent("source", time.thread_time() - started)
            return sums
        digest = await self._digest_of(offer)  # an offer's digest may still be summing: not this step's time
        return await self._timed("source", self._at_source(record, offer, digest, indices, remapped))

    async def _at_source(
        self,
        record: TransferRecord,
        offer: Offer,
        digest: Digest | None,
        indices: I64 | None,
        remapped: SidePlan | None,
    ) -> peer_pb2.BlockSums | None:
        if digest is None:
            why = offer.integrity_off or "no digest was taken"
            self._unchecked(record, why)
            return peer_pb2.BlockSums(unchecked=why)  # the receiver's record says why
        left: U64 | None = None
        if remapped is not None:
            window, picks = stream_windows(self._rng, digest.mode, self.samples, remapped.total_bytes)
            left = await pool_sums(self.executor, offer.pool, len(picks) * window, window_sums, remapped, window, picks)
            if left is None:
                self._unchecked(record, "the offered pool went away")
                return None
        offer_pos, moved = digest.for_pull(indices)
        if remapped is None:  # a block changed here shows where it lands (module docstring, 2.)
            record.integrity_mode, record.integrity_result = digest.mode, "sent"
            record.integrity_blocks = distinct(offer_pos)
        else:  # the windows sent stand for the blocks: the blocks must still be as offered
            changed = await self._changes(offer, offer_pos, moved)
            if changed is None:
                self._unchecked(record, "the offered pool went away")
                return None
            self._checked(record, digest.mode, distinct(offer_pos), bool(len(changed)))
            if len(changed):
                raise changed_after_offer(record, offer, changed)
        if left is not None:
            return peer_pb2.BlockSums(mode=digest.mode, window_bytes=window, windows=picks.tolist(), sums=left.tolist())
        return moved.to_proto()  # the digest's mode, by positions in the pull's stream

    async def _digest_of(self, offer: Offer) -> Digest | None:
        future = offer.digest
        if future is None:
            return None
        try:  # summed already, as a rule: its result without a shield's extra turn of the loop
            return future.result() if future.done() else await asyncio.shield(future)
        except KvxferError as exc:  # e.g. the engine's process memory became unreadable
            offer.integrity_off = f"its blocks could not be summed: {exc}"
            return None

    # -- where the blocks land ------------------------------------------------------------

    async def check_landed(
        self,
        record: TransferRecord,
        sums: peer_pb2.BlockSums | None,
        dst: Pool,
        dst_ids: I64,
        remapped: SidePlan | None = None,
        folded: FoldedSums | None = None,
    ) -> None:
        """Before done: the landed blocks' sums against ``sums`` (the offering daemon's);
        ``remapped``: this side's plan of a remapped stream (its windows are compared);
        ``folded``: those windows summed already, as they landed."""
        started = time.thread_time()
        unfaulted = not self.faults.armed("before_check")  # a corrupt fault goes the general way
        if folded is not None and folded.done and unfaulted and remapped is None:
            self._judge(record, folded.expected, dst_ids, folded.sums)
            self._spent("landed", time.thread_time() - started)
            return
        if sums is not None and remapped is None and unfaulted and landed_as_said(sums, dst, dst_ids):
            # A small offer's every segment, in one loop.
            self._checked(record, sums.mode, len(dst_ids), False)
            self._spent("landed", time.thread_time() - started)
            return
        await self._timed("landed", self._where_landed(record, sums, dst, dst_ids, remapped))

    async def _where_landed(
        self,
        record: TransferRecord,
        sums: peer_pb2.BlockSums | None,
        dst: Pool,
        dst_ids: I64,
        remapped: SidePlan | None,
    ) -> None:
        if not dst.on_gpu and self.faults.corrupts("before_check", record.transfer_id):
            flip_first_bit(dst, dst_ids)
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
        positions, regions, within = peer_entries(sums, len(dst_ids), dst.regions.nbytes)
        expected = np.array(sums.sums[:], dtype=np.uint64)  # a list first: 3x faster than from the field
        await self._compare(record, Digest(sums.mode, positions, regions, within, expected), dst, dst_ids)

    async def check_local(
        self, record: TransferRecord, offer: Offer, indices: I64 | None, dst: Pool, dst_ids: I64
    ) -> None:
        """A local pull, not remapped: what landed against the offer's digest (the source is
        summed again only if that fails, as on a remote pull)."""
        digest = await self._digest_of(offer)
        await self._timed("landed", self._landed_here(record, offer, digest, indices, dst, dst_ids))

    async def _landed_here(
        self, record: TransferRecord, offer: Offer, digest: Digest | None, indices: I64 | None, dst: Pool, dst_ids: I64
    ) -> None:
        if digest is None:
            self._unchecked(record, offer.integrity_off or "no digest was taken")
            return
        if not dst.on_gpu and self.faults.corrupts("before_check", record.transfer_id):
            flip_first_bit(dst, dst_ids)
        try:
            await self._compare(record, digest.for_pull(indices)[1], dst, dst_ids)
        except DataLossError as landed:
            raise await self.changed_since_offer(record, offer, indices) or landed from None

    def checked_as_copied(
        self, record: TransferRecord, offer: Offer, indices: I64 | None, dst: Pool, dst_ids: list[int]
    ) -> bool:
        """A local pull of a whole small offer just copied (a few segments, one assignment
        each): its segments summed where they landed, still in cache, against a digest of every
        segment whole (what ``sampled`` takes of a small offer). False when that is not the
        case, or on a mismatch: :meth:`check_local` then checks, and names what differs."""
        started = time.thread_time()
        digest = digest_now(offer)
        if indices is not None or self.faults.armed("before_check") or not landed_as_offered(digest, dst, dst_ids):
            return False
        assert digest is not None
        self._checked(record, digest.mode, len(dst_ids), False)
        self._spent("landed", time.thread_time() - started)
        return True

    async def changed_since_offer(
        self, record: TransferRecord, offer: Offer, indices: I64 | None
    ) -> DataLossError | None:
        """After a pull of ``indices`` failed its check where it landed: the error naming the
        blocks that changed at the source since the offer, if any did (else it was the way)."""
        digest = await self._digest_of(offer)
        if digest is None:
            return None
        offer_pos, moved = digest.for_pull(indices)
        changed = await self._changes(offer, offer_pos, moved)
        return changed_after_offer(record, offer, changed) if changed is not None and len(changed) else None

    async def _changes(self, offer: Offer, offer_pos: I64, moved: Digest) -> I64 | None:
        """The offer positions whose sums differ from the digest now (None: the pool is gone)."""
        now = await self._sums(offer.pool, offer.block_ids[offer_pos], moved.regions, moved.within)
        return None if now is None else offer_pos[now != moved.sums]

    async def _compare(self, record: TransferRecord, expected: Digest, dst: Pool, dst_ids: I64) -> None:
        """The landed blocks' sums against ``expected`` (by positions of the transfer): the
        record says how it went, DataLossError naming the blocks that differ."""
        if dst.on_gpu:
            self._unchecked(record, "GPU destination: no checksum kernel yet")
            return
        positions = expected.positions
        landed = await self._sums(dst, dst_ids[positions], expected.regions, expected.within)
        if landed is None:
            self._unchecked(record, "the destination pool went away")
            return
        self._judge(record, expected, dst_ids, landed)

    def _judge(self, record: TransferRecord, expected: Digest, dst_ids: I64, landed: U64) -> None:
        """The record says how the landed sums compared; DataLossError names the blocks that differ."""
        bad = landed != expected.sums
        mismatch = bool(bad.any())
        self._checked(record, expected.mode, distinct(expected.positions), mismatch)
        if mismatch:
            raise landed_otherwise(record, dst_ids, expected.positions[bad])

    async def _check_windows(
        self, record: TransferRecord, sums: peer_pb2.BlockSums, dst: Pool, dst_ids: I64, plan: SidePlan
    ) -> None:
        window, picks = peer_windows(sums, plan.total_bytes)
        landed = await pool_sums(self.executor, dst, len(picks) * window, window_sums, plan, window, picks)
        if landed is None:
            self._unchecked(record, "the destination pool went away")
            return
        bad = landed != np.asarray(sums.sums, dtype=np.uint64)
        blocks = len(dst_ids) if sums.mode == "full" else len(blocks_under(dst, plan, window, picks))
        self._checked(record, sums.mode, blocks, bool(bad.any()))
        if bad.any():
            raise stream_otherwise(record, dst, plan, window, picks[bad])

    # -- shared ---------------------------------------------------------------------------

    async def _timed(self, step: str, work: Awaitable[T]) -> T:
        result, seconds = await cpu_timed(work)
        self._spent(step, seconds)
        return result

    async def _sums(
        self, pool: Pool, ids: I64, regions: I64 | None, within: tuple[I64, I64] | None = None
    ) -> U64 | None:
        covered = covered_bytes(pool, ids, regions, within)
        return await pool_sums(self.executor, pool, covered, sum_entries, pool.regions, ids, regions, within)

    def _checked(self, record: TransferRecord, mode: str, blocks: int, mismatch: bool) -> None:
        record.integrity_mode, record.integrity_blocks = mode, blocks
        record.integrity_result = "mismatch" if mismatch else "ok"
        self._count(mode, record.integrity_result, blocks)

    def _unchecked(self, record: TransferRecord, why: str) -> None:
        record.integrity_result = why if why.startswith("not checked") else f"not checked: {why}"
        self._count(record.integrity_mode, "not_checked", 0)
