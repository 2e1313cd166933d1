"""Page-aligned host arrays.

Pools are ``mmap``-ed and so start on a page boundary; numpy's own allocations start 16 bytes
past one (the allocator's header). A copy between two buffers that disagree on their offset
modulo 64 takes the slow path of ``memcpy``: 3 GB/s instead of 8.5 GB/s measured here for a
256 MiB copy. Staging and scratch buffers are therefore page-aligned like the pools.

>>> aligned_empty(10_000).ctypes.data % 4096
0
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["PAGE", "aligned_empty"]

PAGE = 4096


def aligned_empty(nbytes: int, alignment: int = PAGE) -> npt.NDArray[np.uint8]:
    """An uninitialised ``uint8`` array of ``nbytes`` whose first byte is ``alignment``-aligned."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start : start + nbytes]
