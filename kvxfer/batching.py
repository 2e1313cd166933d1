"""Messages on one gRPC stream, one write for all that are ready together.

grpc.aio hands each message through its poller thread: a write costs about the same for 64
bytes as for 64 KiB, and a stream allows one write at a time. So a stream's writer takes the
next message with every message queued behind it (up to :data:`MAX_BATCH` messages and
:data:`MAX_BATCH_BYTES`) in its ``more`` field: one write, and the reader handles them in
order as if each came alone (:func:`unbatched`). A lone message goes as it always did.

Two streams use it: the peers' ``Transfers`` (each transfer's control messages) and an
engine's ``Calls`` (its offers and pulls, and their answers), wherever the other end said it
reads ``more``.

>>> from kvxfer.proto import peer_pb2
>>> queue = asyncio.Queue()
>>> for t in ("a", "b", "c"):
...     queue.put_nowait(peer_pb2.TransferClientMessage(transfer_id=t))
>>> first = asyncio.run(Batches(queue).next())
>>> [m.transfer_id for m in unbatched(first)]
['a', 'b', 'c']
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["CALL_BATCHES", "MAX_BATCH", "MAX_BATCH_BYTES", "Batches", "unbatched"]

#: Most messages in one write, and their most bytes (far below the 16 MiB message limit).
MAX_BATCH, MAX_BATCH_BYTES = 256, 1 << 20

#: The metadata by which each end of an engine's ``Calls`` stream says it reads ``more``: the
#: SDK's at the call, the daemon's as its initial metadata (engine.proto). Neither end batches
#: to one that did not say so (an older SDK or daemon would drop what ``more`` carries).
CALL_BATCHES = ("kvxfer-call-batches", "1")


class Batchable(Protocol):
    """A stream message with a ``repeated <itself> more`` field (see the proto files)."""

    @property
    def more(self) -> Any: ...

    def ByteSize(self) -> int: ...  # noqa: N802 - protobuf's name


M = TypeVar("M", bound=Batchable)


class Batches(Generic[M]):
    """A writer's outbox, read a batch at a time."""

    def __init__(self, outbox: asyncio.Queue[M]) -> None:
        self.outbox: asyncio.Queue[M] = outbox
        self._held: M | None = None  # taken, but the batch it came to was full

    async def next(self) -> M:
        """The next message, carrying in ``more`` those queued behind it that fit."""
        first = self._held if self._held is not None else await self.outbox.get()
        self._held = None
        size = first.ByteSize()
        while not self.outbox.empty() and len(first.more) < MAX_BATCH:
            msg = self.outbox.get_nowait()
            size += msg.ByteSize()
            if size > MAX_BATCH_BYTES:
                self._held = msg
                break
            first.more.append(msg)
        return first


def unbatched(msg: M) -> Iterator[M]:
    """A message read from the stream, then those it carried, in order (what they carry in
    turn is ignored: a writer batches one level only)."""
    yield msg
    yield from msg.more
