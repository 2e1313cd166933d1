"""Sends UCX has not finished, kept alive past the transfer that started them.

A cancelled transfer's sends may still be read by UCX: each runs in its own shielded task
that holds its memory (a view of the pool or of staging) until UCX completes or cancels it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["SEND_LINGER_S", "TrackedSends"]

#: Seconds a send keeps the worker progressed tightly on its own (see ``TrackedSends.run``).
SEND_LINGER_S = 5.0


class TrackedSends:
    """The sends in flight; ``busy()`` keeps UCX progress tight while one lingers."""

    def __init__(self, busy: Callable[[], AbstractContextManager[None]]) -> None:
        self._busy = busy
        self._pending: set[asyncio.Future[Any]] = set()

    def __len__(self) -> int:
        return len(self._pending)

    async def run(self, send: Awaitable[None]) -> None:
        """Run a send in its own task, shielded: when the transfer is cancelled, UCX may still
        read the send's memory (a view of the pool or of staging), so the task keeps it
        referenced (and the pool mapped) until UCX completes or cancels the request.

        The worker is progressed tightly for up to :data:`SEND_LINGER_S` of the send, even
        after the transfer gave up: a send of a fragmented chunk pushes its data itself (UCX's
        copy-in copy-out rendezvous on one host), and the receiver's cancelled receives wait
        for it. A send to a peer that died never completes; past the linger it is progressed
        at the idle pace, so it cannot keep a core busy."""
        inner = asyncio.ensure_future(send)

        async def progressed() -> None:
            with self._busy():
                await asyncio.wait({inner}, timeout=SEND_LINGER_S)
            await inner

        sending = asyncio.ensure_future(progressed())
        self._pending.add(sending)
        sending.add_done_callback(_retire_send(self._pending))
        await asyncio.shield(sending)


def _retire_send(pending: set[asyncio.Future[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    def retire(fut: asyncio.Future[Any]) -> None:
        pending.discard(fut)
        if not fut.cancelled():
            fut.exception()  # retrieved: a send of an abandoned transfer may fail, that is expected

    return retire
