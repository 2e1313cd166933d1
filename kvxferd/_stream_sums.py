"""The sums of a remapped stream: windows of its bytes, which both sides cut alike.

A remapped pull (other TP, head order or block size) lands in blocks cut otherwise than the
offer's, so block sums cannot be compared; the stream's bytes can. The source sums windows of
the stream as it left (every window of :data:`FULL_WINDOW` in ``full``; ``samples`` random
windows of :data:`SAMPLE_WINDOW` in ``sampled``), each side through its own plan of it.

>>> window, picks = stream_windows(np.random.default_rng(1), "full", 8, 20 << 20)
>>> window == FULL_WINDOW, picks.tolist()
(True, [0, 1, 2])
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxfer.errors import InvalidRequestError
from kvxfer.proto import peer_pb2

from ._digest import SAMPLE_WINDOW
from .dataplane.plan import SidePlan, num_chunks, window_pieces
from .memory.pools import Pool

__all__ = ["FULL_WINDOW", "blocks_under", "peer_windows", "stream_windows"]

I64 = npt.NDArray[np.int64]
#: Windows of a remapped stream summed whole in ``full`` mode; a peer's windows must lie between
#: ``MIN_WINDOW`` and ``MAX_WINDOW``.
FULL_WINDOW = 8 << 20
MIN_WINDOW, MAX_WINDOW = 8, 64 << 20


def stream_windows(rng: np.random.Generator, mode: str, samples: int, total_bytes: int) -> tuple[int, I64]:
    """The windows of a remapped stream to sum: all, or a random sample."""
    window = FULL_WINDOW if mode == "full" else SAMPLE_WINDOW
    count = num_chunks(total_bytes, window)
    if mode == "full":
        return window, np.arange(count, dtype=np.int64)
    return window, np.sort(rng.choice(count, min(samples, count), replace=False)).astype(np.int64)


def peer_windows(sums: peer_pb2.BlockSums, total_bytes: int) -> tuple[int, I64]:
    """The window size and windows a peer's sums name, checked to lie inside a stream of
    ``total_bytes`` (InvalidRequestError if not)."""
    window, count = sums.window_bytes, num_chunks(total_bytes, max(1, sums.window_bytes))
    if (
        not MIN_WINDOW <= window <= MAX_WINDOW
        or not sums.windows
        or len(sums.windows) != len(sums.sums)
        or len(sums.windows) > count
        or max(sums.windows) >= count
    ):
        raise InvalidRequestError("the peer's window sums name windows outside this stream")
    return window, np.asarray(sums.windows, dtype=np.int64)


def blocks_under(pool: Pool, plan: SidePlan, window: int, picks: I64) -> I64:
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
