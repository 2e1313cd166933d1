"""Bounded staging memory for packing and unpacking chunks.

A transfer takes all the buffers it needs in one step and keeps them to the end, so an
admitted transfer never waits on another one for memory: no deadlock between daemons that
send and receive at the same time, and memory stays at ``capacity`` however many arrive.

>>> import asyncio
>>> pool = StagingPool(total_bytes=8192, buffer_bytes=4096)
>>> async def demo():
...     async with pool.lease(3) as lease:
...         return len(lease.buffers), pool.in_use
>>> asyncio.run(demo())
(2, 2)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .aligned import CACHE_LINE, aligned_empty

__all__ = ["StagingLease", "StagingPool"]

U8 = npt.NDArray[np.uint8]


def _host_buffer(nbytes: int) -> U8:
    # Touch every page now (np.zeros would map them lazily): a first-use page fault costs more
    # than the copy itself. The slack lets a chunk sit at an engine buffer's alignment.
    buf = aligned_empty(nbytes + CACHE_LINE)
    buf.fill(0)
    return buf


@dataclass
class StagingLease:
    buffers: list[Any]  # numpy uint8 arrays, or CuPy ones for GPU staging
    #: Set when a network operation may still write into the buffers after the transfer gave
    #: up: they are then dropped (and replaced) instead of being handed to the next transfer.
    poisoned: bool = False


class StagingPool:
    def __init__(self, total_bytes: int, buffer_bytes: int, allocate: Callable[[int], Any] | None = None) -> None:
        #: Makes one zero-filled buffer (host memory by default; the GPU data plane passes a
        #: CuPy allocator).
        self._allocate = allocate or _host_buffer
        self.capacity = max(1, total_bytes // buffer_bytes)
        self.buffer_bytes = buffer_bytes
        # Buffers are made on first need (a daemon that receives by scatter never needs its
        # receive staging) and kept for reuse; never more than ``capacity`` of them.
        self._free: list[Any] = []
        self._made = 0
        self._cond = asyncio.Condition()
        self.replaced = 0

    def _new(self) -> Any:
        return self._allocate(self.buffer_bytes)

    @property
    def allocated(self) -> int:
        """Buffers made so far (they are kept for reuse)."""
        return self._made

    @property
    def in_use(self) -> int:
        return self._made - len(self._free)

    @asynccontextmanager
    async def lease(self, count: int) -> AsyncIterator[StagingLease]:
        """Hold ``min(count, capacity)`` buffers (first come, first served) until exit."""
        count = max(0, min(count, self.capacity))
        if count == 0:  # nothing to wait for or give back (UCX gathers or scatters in place)
            yield StagingLease([])
            return
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._free) + self.capacity - self._made >= count)
            while len(self._free) < count:
                self._free.append(self._new())
                self._made += 1
            lease = StagingLease([self._free.pop() for _ in range(count)])
        try:
            yield lease
        finally:
            if lease.poisoned:
                self.replaced += len(lease.buffers)
                lease.buffers = [self._new() for _ in lease.buffers]
            async with self._cond:
                self._free.extend(lease.buffers)
                self._cond.notify_all()
