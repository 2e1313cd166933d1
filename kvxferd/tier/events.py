"""Tier events for routers: which keys became stored on this node, and which went.

A router that places requests where their prefix is stored (or tells a decode engine which
node to load it from, ``from_peer``) subscribes with ``AdminService.WatchTier``. Events are
batched: published into a buffer as they happen and sent every :data:`FLUSH_S` (or once
:data:`MAX_KEYS` are waiting), so a store of a thousand blocks is one message, not a thousand.
A chunk is *stored* once every head of it is in, and *removed* when it leaves the node (not
when it only moves from memory to disk). A subscriber that falls :data:`MAX_PENDING` batches
behind loses them and gets ``overflowed`` on the next: it should look its keys up again. With
no subscriber, publishing costs nothing.

>>> import asyncio
>>> async def demo():
...     events = TierEvents(flush_s=0.01)
...     watch = events.subscribe()
...     events.stored("ns", b"k1"); events.stored("ns", b"k2"); events.removed("ns", b"k0")
...     batch = await anext(watch)
...     events.close()
...     return [list(t.keys) for t in batch.stored], [list(t.keys) for t in batch.removed]
>>> asyncio.run(demo())
([[b'k1', b'k2']], [[b'k0']])
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvxfer.proto import admin_pb2

__all__ = ["FLUSH_S", "MAX_KEYS", "MAX_PENDING", "TierEvents"]

FLUSH_S = 0.05
MAX_KEYS = 4096
MAX_PENDING = 256


class TierEvents:
    def __init__(self, flush_s: float = FLUSH_S) -> None:
        self.flush_s = flush_s
        self._stored: dict[str, list[bytes]] = {}
        self._removed: dict[str, list[bytes]] = {}
        self._waiting = 0
        self._subscribers: list[_Subscriber] = []
        self._flusher: asyncio.TimerHandle | None = None

    def stored(self, namespace: str, key: bytes) -> None:
        self._add(self._stored, namespace, key)

    def removed(self, namespace: str, key: bytes) -> None:
        self._add(self._removed, namespace, key)

    def subscribe(self) -> AsyncIterator[admin_pb2.TierEventBatch]:
        sub = _Subscriber()
        self._subscribers.append(sub)
        return self._follow(sub)

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        for sub in self._subscribers:
            sub.queue.put_nowait(None)
        self._subscribers.clear()

    async def _follow(self, sub: _Subscriber) -> AsyncIterator[admin_pb2.TierEventBatch]:
        try:
            while (batch := await sub.queue.get()) is not None:
                if sub.overflowed:
                    batch.overflowed, sub.overflowed = True, False
                yield batch
        finally:
            if sub in self._subscribers:
                self._subscribers.remove(sub)

    def _add(self, into: dict[str, list[bytes]], namespace: str, key: bytes) -> None:
        if not self._subscribers:
            return
        into.setdefault(namespace, []).append(key)
        self._waiting += 1
        if self._waiting >= MAX_KEYS:
            self._flush()
        elif self._flusher is None:
            self._flusher = asyncio.get_running_loop().call_later(self.flush_s, self._flush)

    def _flush(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        batch = admin_pb2.TierEventBatch(
            stored=[admin_pb2.TierKeys(namespace=ns, keys=keys) for ns, keys in self._stored.items()],
            removed=[admin_pb2.TierKeys(namespace=ns, keys=keys) for ns, keys in self._removed.items()],
        )
        self._stored, self._removed, self._waiting = {}, {}, 0
        for sub in self._subscribers:
            if sub.queue.qsize() >= MAX_PENDING:
                sub.overflowed = True  # this batch is lost to it: it hears so with the next
            else:
                sub.queue.put_nowait(batch)


class _Subscriber:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[admin_pb2.TierEventBatch | None] = asyncio.Queue()
        self.overflowed = False
