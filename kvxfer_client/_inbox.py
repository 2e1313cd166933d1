"""What a session's event stream brought: events for :meth:`next_event`, offers released (kept
for a late ``wait_released``), and layers landed per layer-wise transfer.

Every method runs on the client's event loop.

>>> import asyncio
>>> from kvxfer_client._events import OfferReleased, ReleaseReason
>>> async def demo():
...     inbox = Inbox()
...     inbox.take(OfferReleased("o-1", "p-1", ReleaseReason.PULLED))
...     released = await inbox.wait_released("o-1", None)
...     return released.reason.name, (await inbox.next_event(1.0)).offer_id
>>> asyncio.run(demo())
('PULLED', 'o-1')
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvxfer.errors import DeadlineExceededError, KvxferError

from ._events import LayersLanded, OfferReleased, TransferFailed

__all__ = ["MAX_QUEUED_EVENTS", "Event", "Inbox"]

Event = OfferReleased | TransferFailed
#: Events kept for events()/next_event(); past it the oldest go (counted in events_dropped),
#: so an engine that only calls wait_released() holds a bounded amount.
MAX_QUEUED_EVENTS = 10_000
_RELEASED_MEMORY = 100_000  # released events kept for late wait_released() calls
_LANDED_MEMORY = 10_000  # layer-wise transfers whose landed layers are remembered


class Inbox:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue(MAX_QUEUED_EVENTS)
        #: Events dropped, oldest first, because nobody read them (see MAX_QUEUED_EVENTS).
        self.dropped = 0
        self._released: dict[str, OfferReleased] = {}
        self._waiters: dict[str, asyncio.Future[OfferReleased]] = {}
        #: Layers landed per layer-wise transfer into this session's pools (LayersLanded).
        self._landed: dict[str, int] = {}
        self._landed_changed = asyncio.Event()

    def take(self, event: Event | LayersLanded) -> None:
        """One event off the session's stream."""
        if isinstance(event, LayersLanded):
            self._layers_landed(event)  # many per transfer: kept out of events()
            return
        if isinstance(event, OfferReleased):
            # Kept even when someone waits: a waiter that gave up (its timeout) and asks
            # again must still hear of it.
            if len(self._released) >= _RELEASED_MEMORY:
                self._released.pop(next(iter(self._released)))
            self._released[event.offer_id] = event
            waiter = self._waiters.pop(event.offer_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(event)
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
        self.queue.put_nowait(event)

    def session_ended(self, lost: KvxferError) -> None:
        """The stream ended: whoever waits for a release hears ``lost``; layer waiters look."""
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(lost)
        self._waiters.clear()
        self._landed_changed.set()

    async def next_event(self, timeout_s: float | None) -> Event:
        try:
            return await asyncio.wait_for(self.queue.get(), timeout_s)
        except TimeoutError:
            raise DeadlineExceededError("no event before the deadline") from None

    async def wait_released(
        self, offer_id: str, timeout_s: float | None, lost: KvxferError | None = None
    ) -> OfferReleased:
        if offer_id in self._released:
            return self._released.pop(offer_id)
        if lost is not None:
            raise lost
        fut = self._waiters.setdefault(offer_id, asyncio.get_running_loop().create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            raise DeadlineExceededError(f"offer {offer_id} was not released in time") from None

    async def wait_layers(
        self, transfer_id: str, layers: int, timeout_s: float | None, lost: Callable[[], KvxferError | None]
    ) -> int:
        try:
            async with asyncio.timeout(timeout_s):
                while self._landed.get(transfer_id, 0) < layers:
                    error = lost()
                    if error is not None:
                        raise error
                    await self._landed_changed.wait()
        except TimeoutError:
            raise DeadlineExceededError(f"{layers} layers of transfer {transfer_id} did not land in time") from None
        return self._landed[transfer_id]

    def _layers_landed(self, event: LayersLanded) -> None:
        if len(self._landed) >= _LANDED_MEMORY and event.transfer_id not in self._landed:
            self._landed.pop(next(iter(self._landed)))
        self._landed[event.transfer_id] = max(self._landed.get(event.transfer_id, 0), event.layers)
        changed, self._landed_changed = self._landed_changed, asyncio.Event()
        changed.set()
