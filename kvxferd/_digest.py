"""What an offer's digest covers, how a pull picks its part of it, and how a peer's sums of
that part are read (checked to lie inside the transfer).

``full`` covers every offered block whole. ``sampled`` covers ``k`` windows of at most
:data:`SAMPLE_WINDOW` bytes spread over the offer's bytes: the offer (its blocks in list
order, each block's segments in region order) is cut into ``k`` equal strata and each window
starts at a random byte of its own stratum, cut to the segment it starts in. The cost is
``k`` windows whatever the layout (two segments of 128 MiB or 8,192 of 32 KiB), and every
part of the offer is equally likely to be looked at. The offering and the receiving daemon
sum the same bytes: the same region of the same block position, from the same byte of the
segment (the two pools' layouts match segment for segment, or the pull is remapped and
summed by windows of its stream instead).

>>> positions, regions, within = sample_offer(np.random.default_rng(1), 2, np.array([1 << 27, 1 << 27]), 4)
>>> positions.tolist(), regions.tolist()                 # 4 windows over 2 blocks of 2 x 128 MiB
([0, 0, 1, 1], [0, 1, 0, 1])
>>> within[1].tolist()                                   # 64 KiB each
[65536, 65536, 65536, 65536]
>>> digest = Digest("sampled", positions, regions, within, np.arange(4, dtype=np.uint64))
>>> offer_pos, moved = digest.for_pull(np.array([1]))   # a pull of block 1 alone
>>> offer_pos.tolist(), moved.positions.tolist(), moved.sums.tolist()
([1, 1], [0, 0], [2, 3])
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import InvalidRequestError
from kvxfer.proto import peer_pb2

from ._cpu_time import in_thread
from .dataplane.checksum import block_sums, segment_sums
from .dataplane.hostmem import HostMemory
from .dataplane.plan import RegionTable
from .memory.pools import Pool

__all__ = [
    "INLINE_BYTES",
    "SAMPLE_WINDOW",
    "Digest",
    "covered_bytes",
    "peer_entries",
    "pool_sums",
    "sample_offer",
    "settle",
    "sum_entries",
]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
#: The most bytes one sample sums (about one segment of a Llama-8B-sized 16-token block).
SAMPLE_WINDOW = 64 << 10
#: Sums over at most this many bytes run on the event loop (about 0.2 ms here); more go to
#: the copy threads.
INLINE_BYTES = 1 << 20


@dataclass(frozen=True)
class Digest:
    """Sums of entries at ``positions`` of a block list: of region ``regions[j]`` of the block
    (sampled; only its bytes ``within[0][j]`` onwards, ``within[1][j]`` of them, where
    ``within`` is set) or of the whole block (``regions`` None)."""

    mode: str
    positions: I64
    regions: I64 | None
    within: tuple[I64, I64] | None
    sums: U64

    def to_proto(self) -> peer_pb2.BlockSums:
        """These sums as a pull is sent them (by positions in its stream)."""
        return peer_pb2.BlockSums(
            mode=self.mode,
            positions=self.positions.tolist(),
            sums=self.sums.tolist(),
            regions=self.regions.tolist() if self.regions is not None else [],
            starts=self.within[0].tolist() if self.within is not None else [],
            lengths=self.within[1].tolist() if self.within is not None else [],
        )

    @functools.cached_property
    def sent_whole(self) -> tuple[int, peer_pb2.BlockSums]:
        """What a pull of every offered block is sent (the same for each of its readers, so
        built once): how many blocks the sums cover, and the sums."""
        sums = self.to_proto()
        return len(set(sums.positions)), sums

    def for_pull(self, indices: I64 | None) -> tuple[I64, Digest]:
        """The entries a pull of the offer's blocks at ``indices`` (None: all) moves: their
        offer positions, and the same entries by positions in the pull's stream."""
        if indices is None:
            return self.positions, self
        order = np.argsort(indices, kind="stable")
        at = np.minimum(np.searchsorted(indices, self.positions, sorter=order), len(indices) - 1)
        stream = order[at]
        moved = indices[stream] == self.positions
        regions = self.regions[moved] if self.regions is not None else None
        within = (self.within[0][moved], self.within[1][moved]) if self.within is not None else None
        return self.positions[moved], Digest(self.mode, stream[moved], regions, within, self.sums[moved])


def sample_offer(
    rng: np.random.Generator, blocks: int, nbytes: npt.NDArray[np.int64], samples: int
) -> tuple[I64, I64, tuple[I64, I64] | None]:
    """``samples`` windows over ``blocks`` blocks of segments of ``nbytes`` (one per region):
    each window's block position, region, and first byte in its segment and length (None:
    every segment whole, for an offer of no more segments than samples, none over a window);
    windows that came out the same (segments smaller than a stratum) are kept once."""
    sizes = np.asarray(nbytes, dtype=np.int64).tolist()
    if blocks * len(sizes) <= samples and max(sizes) <= SAMPLE_WINDOW:
        return _every_segment(blocks, len(sizes))
    ends = list(itertools.accumulate(sizes))
    per_block = ends[-1]
    total = blocks * per_block
    k = max(1, min(samples, total))
    kept: list[tuple[int, int, int, int]] = []
    last = -1
    # A few windows: plain Python (numpy's per-call cost would be most of the work).
    for s, draw in enumerate(rng.random(k).tolist()):
        lo, hi = s * total // k, (s + 1) * total // k
        position, byte = divmod(lo + int(draw * (hi - lo)), per_block)
        region = bisect.bisect_right(ends, byte)
        seg = sizes[region]
        length = min(seg, SAMPLE_WINDOW)
        # From the picked byte, moved back to fit the segment and to a word boundary (the
        # sums read 64-bit words where the segment starts on one).
        start = min(byte - (ends[region] - seg), seg - length) & ~7
        at = position * per_block + ends[region] - seg + start
        if at != last:  # picks rise with the strata: windows that came out the same are neighbours
            kept.append((position, region, start, length))
            last = at
    positions, regions, starts, lengths = (np.array(column, dtype=np.int64) for column in zip(*kept, strict=True))
    return positions, regions, (starts, lengths)


@functools.lru_cache(maxsize=64)
def _every_segment(blocks: int, regions: int) -> tuple[I64, I64, None]:
    """Each block position and region of a small offer (made once per shape: read-only)."""
    positions, region_of = np.repeat(np.arange(blocks), regions), np.tile(np.arange(regions), blocks)
    positions.flags.writeable = region_of.flags.writeable = False
    return positions, region_of, None


def sum_entries(
    memory: HostMemory, table: RegionTable, ids: I64, regions: I64 | None, within: tuple[I64, I64] | None
) -> U64:
    """Whole blocks' sums (``regions`` None), or one region's segment (or part of it) of each."""
    if regions is None:
        return block_sums(memory, table, ids)
    return segment_sums(memory, table, ids, regions, within)


def covered_bytes(pool: Pool, ids: I64, regions: I64 | None, within: tuple[I64, I64] | None) -> int:
    """Bytes the sums of these entries read."""
    if regions is None:
        return len(ids) * int(pool.regions.nbytes.sum())
    if within is not None:
        return int(within[1].sum())
    if len(regions) <= 64:  # the usual sample: plain Python beats numpy's per-call cost
        return sum(map(pool.regions.lists[3].__getitem__, regions.tolist()))
    return int(pool.regions.nbytes[regions].sum())


def peer_entries(sums: peer_pb2.BlockSums, count: int, nbytes: I64) -> tuple[I64, I64 | None, tuple[I64, I64] | None]:
    """The positions, regions and windows a peer's block sums name, checked to lie inside a
    transfer of ``count`` blocks of segments of ``nbytes`` (InvalidRequestError if not)."""
    positions, regions, starts, lengths = (
        list(sums.positions),
        list(sums.regions),
        list(sums.starts),
        list(sums.lengths),
    )
    n = len(positions)
    fits = len(sums.sums) == n and max(positions) < count
    if fits and regions:
        fits = len(regions) == n and max(regions) < len(nbytes)
    if fits and (starts or lengths):
        fits = bool(regions) and len(starts) == len(lengths) == n and _inside(starts, lengths, regions, nbytes)
    if not fits:
        raise InvalidRequestError("the peer's block sums name blocks, regions or bytes outside this transfer")
    within = (np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)) if starts else None
    return np.array(positions, dtype=np.int64), np.array(regions, dtype=np.int64) if regions else None, within


def _inside(starts: list[int], lengths: list[int], regions: list[int], nbytes: I64) -> bool:
    """Every window is bytes of its segment, and not empty (uint64 from the wire: any size)."""
    if len(starts) <= 64:  # the usual sample: plain Python beats numpy's per-call cost
        sizes = nbytes.tolist()
        return all(n > 0 and s + n <= sizes[r] for s, n, r in zip(starts, lengths, regions, strict=True))
    if max(max(starts), max(lengths)) >= 1 << 48:  # past any pool, and int64 holds the sums below
        return False
    s, n = np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)
    return bool(((n > 0) & (s + n <= nbytes[np.array(regions, dtype=np.int64)])).all())


def settle(future: asyncio.Future[Any], task: asyncio.Future[Any], summed: Callable[[Any], Any]) -> None:
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


async def pool_sums(executor: Executor, pool: Pool, nbytes: int, sums: Callable[..., U64], *args: Any) -> U64 | None:
    """``sums(pool's host memory, *args)`` over ``nbytes``: on the loop when small, else in a
    copy thread; None when the pool is going away."""
    if pool.closing:
        return None
    if nbytes <= INLINE_BYTES:  # on the loop: no deregistration can come between
        return sums(pool.host_memory(), *args)
    with pool.in_use():  # a deregistration meanwhile unmaps only once this ends
        return await in_thread(executor, sums, pool.host_memory(), *args)
