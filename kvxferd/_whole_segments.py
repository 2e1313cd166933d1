"""Small offers: every segment summed whole, where it lies, in one loop.

``sampled`` takes every segment of an offer of no more segments than samples (each at most a
window): a one-block 4 KiB offer is two 2 KiB segments. Such sums cost a product each; the
general path around them (sample tables, gathers, numpy per call) cost ten times that. So
where both sides are mapped here and the segments are few (:data:`FEW_SEGMENTS`), the digest,
the check where the blocks land and a local pull's check right after its copy are one plain
loop each over :func:`.dataplane.checksum.whole_segment_sums`. They agree with the general
path entry for entry (the digest's order: block by block, region order within), and any
mismatch goes back to it, which names the blocks.

>>> positions, regions = block_major(2, 2)
>>> positions, regions
((0, 0, 1, 1), (0, 1, 0, 1))
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.proto import peer_pb2

from ._digest import Digest
from ._offers import Offer
from .dataplane.checksum import whole_segment_sums
from .dataplane.hostcopy import FEW_SEGMENTS
from .memory.pools import Pool

__all__ = ["FEW_SEGMENTS", "block_major", "digest_now", "landed_as_offered", "landed_as_said", "offer_sums"]

U64 = npt.NDArray[np.uint64]


def offer_sums(pool: Pool, block_ids: npt.NDArray[np.int64]) -> U64 | None:
    """Every segment of these blocks, whole (None: not mapped here, or not word-aligned)."""
    if pool.process is not None or pool.on_gpu:
        return None
    whole = whole_segment_sums(pool.arrays, pool.regions, block_ids.tolist())
    return None if whole is None else np.array(whole, dtype=np.uint64)


def landed_as_offered(digest: Digest | None, dst: Pool, dst_ids: list[int]) -> bool:
    """A whole offer's blocks landed in ``dst_ids`` as its digest of every segment whole says
    (False: the digest is not such, the destination not mapped here, or a mismatch)."""
    if digest is None or digest.regions is None or digest.within is not None:
        return False
    if dst.closing or dst.on_gpu or dst.process is not None:
        return False
    expected: list[int] = digest.sums.tolist()
    return whole_segment_sums(dst.arrays, dst.regions, dst_ids) == expected


def landed_as_said(sums: peer_pb2.BlockSums, dst: Pool, dst_ids: npt.NDArray[np.int64]) -> bool:
    """The peer's sums hold every segment of a few blocks whole, block by block, and the
    segments that landed in ``dst_ids`` match them (False otherwise)."""
    regions = len(dst.regions.lists[3])
    count = len(dst_ids) * regions
    if count > FEW_SEGMENTS or len(sums.sums) != count or sums.starts:
        return False
    if dst.closing or dst.on_gpu or dst.process is not None:
        return False
    positions, region_of = block_major(len(dst_ids), regions)
    if tuple(sums.positions) != positions or tuple(sums.regions) != region_of:
        return False
    return whole_segment_sums(dst.arrays, dst.regions, dst_ids.tolist()) == list(sums.sums)


@functools.lru_cache(maxsize=64)
def block_major(blocks: int, regions: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Block positions and regions of every segment of ``blocks`` blocks, block by block."""
    return tuple(p for p in range(blocks) for _ in range(regions)), tuple(range(regions)) * blocks


def digest_now(offer: Offer) -> Digest | None:
    """The offer's digest if it is summed already (None: not taken, still summing, or failed)."""
    future: Any = offer.digest
    if future is None or not future.done() or future.cancelled() or future.exception() is not None:
        return None
    digest: Digest | None = future.result()
    return digest
