"""What every handoff path shares (the peer streams, the transports and the handoff rooms):
chunk-size bounds and steps with a deadline of their own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from kvxfer.errors import DeadlineExceededError

__all__ = ["MAX_CHUNK", "MIN_CHUNK", "within"]

T = TypeVar("T")

#: Chunk sizes a remote transfer may use (the puller offers one, the sender may lower it).
MIN_CHUNK = 64 << 10
MAX_CHUNK = 256 << 20


async def within(aw: Awaitable[T], timeout: float | None, what: str = "a step of the transfer") -> T:
    """``await aw`` with a deadline; past it, DeadlineExceededError naming ``what`` and the
    deadline. Unlike ``asyncio.wait_for`` on Python 3.11, this never swallows a cancellation
    that arrives as ``aw`` completes (an outer pull deadline would be lost).

    >>> async def slow() -> None:
    ...     await asyncio.sleep(1)
    >>> asyncio.run(within(slow(), 0.01, "the peer's 'sent'"))
    Traceback (most recent call last):
    ...
    kvxfer_client.DeadlineExceededError: the peer's 'sent' did not happen within its deadline of 0.01s
    """
    try:
        async with asyncio.timeout(timeout):
            return await aw
    except TimeoutError:
        raise DeadlineExceededError(f"{what} did not happen within its deadline of {timeout}s") from None
