"""Sums folded into a copy: the windows a peer's sums name, summed where they landed by the
copy thread that landed them, while their bytes are still in its cache and beside the other
threads' copies, instead of on the loop once the whole read is done.

A read segment to segment (:mod:`.dataplane.segment_reads`) says which rows each copy thread
landed; :meth:`FoldedSums.landed` sums the windows inside them. The pull's check then compares
those sums with the peer's without reading the destination again
(``IntegrityChecks.check_landed``). Sums of whole blocks (``full``) are not folded.

>>> from kvxfer.proto import peer_pb2
>>> from kvxferd.dataplane.hostmem import MappedMemory
>>> from kvxferd.dataplane.plan import RegionTable
>>> buf = np.arange(4096, dtype=np.uint8)
>>> table = RegionTable.from_regions([(0, 0, 1024, 512), (0, 512, 1024, 512)])
>>> said = peer_pb2.BlockSums(mode="sampled", positions=[1, 0], regions=[1, 0], starts=[64, 0],
...                           lengths=[128, 512], sums=[0, 0])
>>> folded = fold_windows(said, MappedMemory([buf]), table, np.array([2, 0]))
>>> folded.segments.tolist()                   # rows in stream order: region-major, then blocks
[3, 0]
>>> folded.landed(0, 2)                        # rows 0..1 landed: the second window is in them
>>> folded.landed(2, 4)
>>> entries = sum_entries(MappedMemory([buf]), table, np.array([0, 2]), np.array([1, 0]),
...                       (np.array([64, 0]), np.array([128, 512])))
>>> (folded.sums == entries).all()
np.True_
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxfer.proto import peer_pb2

from ._digest import Digest, peer_entries, sum_entries
from .dataplane.hostmem import HostMemory
from .dataplane.plan import RegionTable

__all__ = ["FoldedSums", "fold_windows"]

I64 = npt.NDArray[np.int64]


class FoldedSums:
    """The windows of a peer's sums in a read of blocks ``ids``, and their sums as landed
    (each filled in by the thread that landed its row; read once every thread is done)."""

    def __init__(self, expected: Digest, memory: HostMemory, table: RegionTable, ids: I64) -> None:
        assert expected.regions is not None
        #: What the peer said, checked to lie inside the read.
        self.expected = expected
        #: Each window's row in the read's stream (region-major, then the blocks in order).
        self.segments = expected.regions * len(ids) + expected.positions
        self.sums = np.zeros(len(expected.positions), dtype=np.uint64)
        #: Set once every row landed and every window was summed.
        self.done = False
        self._memory, self._table, self._ids = memory, table, ids[expected.positions]

    def landed(self, lo: int, hi: int) -> None:
        """Rows ``lo .. hi - 1`` landed: sum the windows in them (in the thread that landed them)."""
        pick = np.flatnonzero((self.segments >= lo) & (self.segments < hi))
        if not len(pick):
            return
        e = self.expected
        assert e.regions is not None
        within = (e.within[0][pick], e.within[1][pick]) if e.within is not None else None
        self.sums[pick] = sum_entries(self._memory, self._table, self._ids[pick], e.regions[pick], within)


def fold_windows(
    sums: peer_pb2.BlockSums | None, memory: HostMemory, table: RegionTable, ids: I64
) -> FoldedSums | None:
    """The windows of ``sums`` to sum as a read of blocks ``ids`` lands (checked first: a
    peer's numbers; InvalidRequestError if they name bytes outside the read); None where
    there are none, or they are whole blocks."""
    if sums is None or not len(sums.positions) or sums.window_bytes:
        return None
    positions, regions, within = peer_entries(sums, len(ids), table.nbytes)
    if regions is None:
        return None
    expected = Digest(sums.mode, positions, regions, within, np.array(sums.sums[:], dtype=np.uint64))
    return FoldedSums(expected, memory, table, ids)
