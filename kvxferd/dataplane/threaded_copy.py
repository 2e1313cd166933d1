"""Host copies dealt to copy threads: a stream of chunks between two host memories, inline
when it is small, else round-robin over the threads, each stopping at its next chunk when the
copy is given up (so nobody reuses a destination a thread can still write)."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from .aligned import CACHE_LINE, aligned_empty
from .hostmem import HostMemory, copy_between
from .plan import SidePlan

__all__ = ["INLINE_COPY_BYTES", "copy_in_threads", "copy_plan", "in_copy_threads"]

#: Local host handoffs up to this size are copied on the event loop (about 10 us at memory
#: speed); larger ones go to the copy threads.
INLINE_COPY_BYTES = 128 << 10


async def copy_in_threads(
    executor: Executor,
    threads: int,
    src: tuple[HostMemory, SidePlan],
    dst: tuple[HostMemory, SidePlan],
    single_pass: bool,
) -> None:
    """Copy a stream between two host memories: inline when small, else the chunks dealt
    round-robin to ``threads`` copy threads (a lone handoff uses them all)."""
    src_plan = src[1]
    if src_plan.total_bytes <= INLINE_COPY_BYTES:
        # Microseconds of copying: the hop to a copy thread and back would cost more.
        copy_plan(src, dst, single_pass)
        return
    parts = min(threads, len(src_plan.chunks))
    await in_copy_threads(executor, parts, functools.partial(copy_plan, src, dst, single_pass))


async def in_copy_threads(executor: Executor, parts: int, work: Callable[[threading.Event, int, int], None]) -> None:
    """``work(stop, part, parts)`` for each of ``parts`` shares, in the copy threads. Each
    share checks ``stop`` before its next step: when the copy is given up (a share failed,
    or the caller was cancelled) this sets it and waits for every share to stop, so that
    nobody hears "failed" or "cancelled" (and reuses the destination) while one can still
    write there."""
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    copying = [loop.run_in_executor(executor, work, stop, k, parts) for k in range(parts)]
    try:
        await asyncio.shield(asyncio.gather(*copying))
    except BaseException:
        stop.set()
        await asyncio.wait(copying)
        raise


def copy_plan(
    src: tuple[HostMemory, SidePlan],
    dst: tuple[HostMemory, SidePlan],
    single_pass: bool,
    stop: threading.Event | None = None,
    part: int = 0,
    parts: int = 1,
) -> None:
    """Copy chunks ``part``, ``part + parts``, ... of the plan (one copy thread's share),
    until ``stop`` is set."""
    (src_memory, src_plan), (dst_memory, dst_plan) = src, dst
    scratch = _scratch(src_plan.chunk_bytes)  # two engines' processes, numpy's copies, small pieces
    for a, b in zip(src_plan.chunks[part::parts], dst_plan.chunks[part::parts], strict=True):
        if stop is not None and stop.is_set():
            return
        copy_between(src_memory, a, dst_memory, b, scratch, single_pass)


_SCRATCH: dict[tuple[int, int], Any] = {}


def _scratch(nbytes: int) -> Any:
    """One reusable scratch buffer per copy thread (runs inside the executor)."""
    key = (threading.get_ident(), nbytes)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = aligned_empty(nbytes + CACHE_LINE)
        buf.fill(0)
    return buf
