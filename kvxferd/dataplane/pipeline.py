"""The chunk pipeline both directions of a UCX transfer run: chunks in order, ``window`` in
flight, staging buffers handed from chunk to chunk, and on the first failure every other
chunk cancelled (the lease marked poisoned: UCX may still touch its buffers)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import UnavailableError

from .plan import ChunkPlan, SidePlan
from .staging import StagingLease

__all__ = ["ChunkFlow", "run_pipeline"]

#: Failures a pipeline raises as they are; any other becomes an UnavailableError.
_PASSED_ON = (asyncio.CancelledError, UnavailableError)


@dataclass(frozen=True)
class ChunkFlow:
    """What one side of a transfer moves and with what: the chunks of ``plan``, the staging
    buffers of ``lease`` for the ones that must be staged, ``window`` chunks at once."""

    plan: SidePlan
    lease: StagingLease
    window: int


async def run_pipeline(
    flow: ChunkFlow,
    move: Callable[[ChunkPlan, Any], Awaitable[None]],
    pack: Callable[[ChunkPlan, Any], Awaitable[None]] | None = None,
    stage: bool = True,
    zero_copy: bool = True,
) -> None:
    """Move the chunks of ``flow.plan`` in order, at most ``flow.window`` at once.

    A fragmented chunk takes a staging buffer when ``stage`` (and is packed into it first when
    ``pack`` is given); a contiguous one moves in place unless ``zero_copy`` is off. On the first
    failure the other chunks are cancelled and the lease is marked poisoned, since UCX may still
    touch its buffers.
    """
    plan, lease = flow.plan, flow.lease
    if len(plan.chunks) == 1:
        await _move_one(flow, move, pack, stage, zero_copy)
        return
    free: asyncio.Queue[Any] = asyncio.Queue()
    for buf in lease.buffers:
        free.put_nowait(buf)
    slots = asyncio.Semaphore(flow.window)

    failures: list[BaseException] = []

    async def run(chunk: ChunkPlan, staged: Any) -> None:
        try:
            await move(chunk, staged)
        except Exception as exc:
            failures.append(exc)  # seen by the loop below before it starts another chunk
            raise
        finally:
            if staged is not None:
                free.put_nowait(staged)
            slots.release()

    tasks: list[asyncio.Task[None]] = []
    try:
        for chunk in plan.chunks:
            await slots.acquire()
            in_place = zero_copy and chunk.contiguous is not None
            staged = None if in_place or not stage else await free.get()
            if staged is not None and pack is not None:
                await pack(chunk, staged)
            tasks.append(asyncio.create_task(run(chunk, staged)))
            if failures:
                raise failures[0]
        await asyncio.gather(*tasks)
    except BaseException as exc:
        lease.poisoned = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(exc, _PASSED_ON):
            raise
        raise UnavailableError(f"UCX transfer failed: {exc!r}") from exc


async def _move_one(
    flow: ChunkFlow,
    move: Callable[[ChunkPlan, Any], Awaitable[None]],
    pack: Callable[[ChunkPlan, Any], Awaitable[None]] | None,
    stage: bool,
    zero_copy: bool,
) -> None:
    """A one-chunk plan (a small handoff), moved in this task: a task for the chunk cost two
    turns of the loop on the handoff's critical path."""
    [chunk] = flow.plan.chunks
    in_place = zero_copy and chunk.contiguous is not None
    staged = None if in_place or not stage else flow.lease.buffers[0]
    try:
        if staged is not None and pack is not None:
            await pack(chunk, staged)
        await move(chunk, staged)
    except BaseException as exc:
        flow.lease.poisoned = True
        if isinstance(exc, _PASSED_ON):
            raise
        raise UnavailableError(f"UCX transfer failed: {exc!r}") from exc
