"""Step 1 of the integrity checks (:mod:`._integrity`): an offer's digest.

Once an offer is written (the offer call, or the layers-ready call that completes a
layer-wise offer), the offering daemon sums what its digest covers (:mod:`._digest`) before
it answers: an engine that writes a block once its offer call returns has broken the offer,
and the digest must not have seen that write. A small offer's segments are summed where they
lie (:mod:`._whole_segments`), up to :data:`._digest.INLINE_BYTES` on the loop; more is
summed in a copy thread while the answer goes out, and a pull that comes sooner awaits
``offer.digest``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np
import numpy.typing as npt

from kvxfer.errors import KvxferError

from ._cpu_time import cpu_timed
from ._digest import INLINE_BYTES, Digest, covered_bytes, sample_offer, settle, sum_entries
from ._log import log_event
from ._offers import Offer
from ._whole_segments import offer_sums
from .memory.pools import Pool

__all__ = ["OfferDigests"]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
Sums = Callable[[Pool, I64, "I64 | None", "tuple[I64, I64] | None"], Awaitable["U64 | None"]]


class OfferDigests:
    """Takes offers' digests: ``sums(pool, ids, regions, within)`` sums a large one off the
    loop, ``spent(step, seconds)`` hears of the CPU time."""

    def __init__(
        self, mode: str, samples: int, rng: np.random.Generator, sums: Sums, spent: Callable[[str, float], None]
    ) -> None:
        self.mode, self.samples, self._rng, self._sums, self._spent = mode, samples, rng, sums, spent

    def take(self, offer: Offer) -> None:
        """Sum the offer's blocks now (a large offer's in a copy thread) if it is written and not
        summed yet (``offer.integrity_off`` says why not, where it will not be)."""
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
        future: asyncio.Future[Digest | None] = asyncio.get_running_loop().create_future()
        offer.digest = future
        # Not deferred past the answer (a turn of the loop later, say): an engine that rewrites
        # a block right after its offer call returns would then be summed with its rewrite.
        self._sum_digest(offer, future)

    def _sum_digest(self, offer: Offer, future: asyncio.Future[Digest | None]) -> None:
        try:
            self._sum_into(offer, future)
        except Exception as exc:  # noqa: BLE001 - a pull awaiting the digest fails, not waits forever
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: an offer nobody pulls logs no warning
            log_event("integrity.digest_failed", logging.WARNING, offer_id=offer.offer_id, detail=repr(exc))

    def _sum_into(self, offer: Offer, future: asyncio.Future[Digest | None]) -> None:
        """Sum what the offer's digest covers into ``future``: here when small, else in a copy
        thread (see the module docstring, 1.)."""
        started = time.thread_time()
        regions: I64 | None = None
        within: tuple[I64, I64] | None = None
        if self.mode == "full":
            positions = np.arange(len(offer.block_ids), dtype=np.int64)
        else:
            positions, regions, within = sample_offer(
                self._rng, len(offer.block_ids), offer.pool.regions.nbytes, self.samples
            )

        def summed(sums: U64 | None) -> Digest | None:
            if sums is None:
                offer.integrity_off = "the offered pool went away before its blocks were summed"
                return None
            log_event("integrity.digest", logging.DEBUG, offer_id=offer.offer_id, mode=self.mode, sums=len(sums))
            return Digest(self.mode, positions, regions, within, sums)

        if offer.pool.closing:
            future.set_result(summed(None))
            return
        whole = offer_sums(offer.pool, offer.block_ids) if regions is not None and within is None else None
        if whole is not None:  # every segment whole, summed where it lies (:mod:`._whole_segments`)
            future.set_result(summed(whole))
            self._spent("digest", time.thread_time() - started)
            return
        ids = offer.block_ids[positions]
        if covered_bytes(offer.pool, ids, regions, within) <= INLINE_BYTES:
            try:
                memory = offer.pool.host_memory()
                future.set_result(summed(sum_entries(memory, offer.pool.regions, ids, regions, within)))
            except KvxferError as exc:  # e.g. an engine's process memory that cannot be read
                offer.integrity_off = f"its blocks could not be summed: {exc}"
                future.set_result(None)
            finally:
                self._spent("digest", time.thread_time() - started)
            return
        self._spent("digest", time.thread_time() - started)
        task = asyncio.ensure_future(self._timed(self._sums(offer.pool, ids, regions, within)))
        task.add_done_callback(lambda t: settle(future, t, summed))

    async def _timed(self, work: Awaitable[U64 | None]) -> U64 | None:
        result, seconds = await cpu_timed(work)
        self._spent("digest", seconds)
        return result
