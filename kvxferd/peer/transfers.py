"""``PeerService.Transfers``: a peer's pulls of our offers, multiplexed on one long-lived stream.

Each ``start`` runs the node's ``serve`` as its own task, which sees its transfer as an
:class:`~kvxferd.peer.serve_request.OffererStream` (:class:`_OffererStream` here): its messages go
out tagged with its transfer id, the puller's ``done`` and ``abort`` come back to it. Per
transfer, this is what a stream of its own gave before: a deadline (the start's
``deadline_s``, counted from reading it), the puller leaving (``abort``, or the stream's loss)
cancels its task, and its failure goes back as ``failed`` with the status code of its kvxfer
error (``edge.rpc.status_of``, the one mapping).

One writer task sends every message (gRPC allows one write at a time, and a serving task may
be cancelled at any await: its messages are queued, never written halfway). A stream holds at
most :data:`MAX_TRANSFERS` transfers at once; more are refused with ``RESOURCE_EXHAUSTED``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from kvxfer.batching import Batches, unbatched
from kvxfer.errors import (
    CancelledError,
    DeadlineExceededError,
    InvalidRequestError,
    KvxferError,
    ResourceExhaustedError,
)
from kvxfer.proto import peer_pb2

from .._log import log_event
from ..edge import wire
from ..edge.rpc import status_of
from .identity import PeerCertificate
from .serve_request import PeerNode, read_start

__all__ = ["MAX_TRANSFERS", "serve_transfers"]

#: Transfers one stream may have running at once (a decode daemon's pulls in flight from
#: one peer are far fewer).
MAX_TRANSFERS = 4096
#: How long past its deadline a transfer's task may run before it is cut short: the handoff
#: fails itself at the deadline; this bounds only what comes before its own clock starts.
BACKSTOP_S = 1.0


async def serve_transfers(context: Any, node: PeerNode) -> None:
    """Serve one ``Transfers`` stream until the puller closes it or it is lost: then every
    transfer still running on it is left by its puller."""
    running: dict[str, _OffererStream] = {}
    outbox: asyncio.Queue[peer_pb2.TransferServerMessage] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    certificate = PeerCertificate(context, bool(node.settings.tls_cert))

    def refuse(transfer_id: str, exc: Exception) -> None:
        code, detail = status_of("Transfers", exc)
        reason = exc.reason if isinstance(exc, KvxferError) else ""
        failed = peer_pb2.TransferError(code=code.value[0], detail=detail, reason=reason)
        outbox.put_nowait(peer_pb2.TransferServerMessage(transfer_id=transfer_id, failed=failed))

    async def run(transfer: _OffererStream, start: peer_pb2.TransferStart) -> None:
        try:
            settings = node.settings
            request = read_start(start, settings.pull_timeout_s, settings.peer_timeout_s)
            certificate.check(request.receiver_daemon_id)  # mTLS: the puller is who it says
            if request.transfer_id != transfer.transfer_id:
                raise InvalidRequestError("start's transfer_id differs from its message's")
            transfer.ends_at = loop.time() + request.deadline_s
            # A backstop for the steps before the handoff's own deadline starts (the claim).
            async with asyncio.timeout_at(transfer.ends_at + BACKSTOP_S):
                await node.serve(request, transfer)
        except asyncio.CancelledError:
            if not transfer.puller_gone():  # cancelled here before the handoff knew of it
                refuse(transfer.transfer_id, CancelledError(f"transfer {transfer.transfer_id} was cancelled"))
        except TimeoutError:
            detail = f"transfer {transfer.transfer_id} exceeded its deadline"
            refuse(transfer.transfer_id, DeadlineExceededError(detail))
        except Exception as exc:  # noqa: BLE001 - every failure goes back as failed
            if not transfer.puller_gone():
                refuse(transfer.transfer_id, exc)
        finally:
            if running.get(transfer.transfer_id) is transfer:
                del running[transfer.transfer_id]

    def take(msg: peer_pb2.TransferClientMessage) -> None:
        """Start, done or abort one transfer."""
        transfer_id, kind = msg.transfer_id, msg.WhichOneof("msg")
        transfer = running.get(transfer_id)
        if kind == "start":
            try:
                wire.transfer_id(transfer_id, required=True)
                if transfer is not None:
                    raise InvalidRequestError(f"transfer {transfer_id!r} is already running on this stream")
                if len(running) >= MAX_TRANSFERS:
                    raise ResourceExhaustedError(f"more than {MAX_TRANSFERS} transfers running on one stream")
            except (InvalidRequestError, ResourceExhaustedError) as exc:
                refuse(transfer_id[:128], exc)
                return
            transfer = _OffererStream(transfer_id, outbox)
            running[transfer_id] = transfer
            transfer.task = asyncio.create_task(run(transfer, msg.start), name=f"serve-{transfer_id}")
        elif transfer is None:
            return  # a transfer that already ended here (its done or abort crossed our failed)
        elif kind == "done":
            transfer.inbox.put_nowait(msg.done)
        else:  # abort, or a message this daemon does not know: the puller is not following
            transfer.leave()

    writer = asyncio.create_task(_write_all(context, outbox), name="transfers-writer")
    try:
        while (batch := await context.read()) is not grpc.aio.EOF:
            for msg in unbatched(batch):
                take(msg)
            await asyncio.sleep(0)  # the transfers started or woken go on before the next read
    finally:
        # The puller closed its end or the stream is lost: it waits for none of these.
        tasks = []
        for transfer in list(running.values()):
            transfer.leave()
            if transfer.task is not None:
                tasks.append(transfer.task)
        await asyncio.gather(*tasks, return_exceptions=True)
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)


async def _write_all(context: Any, outbox: asyncio.Queue[peer_pb2.TransferServerMessage]) -> None:
    """Write the stream's messages as they come, those ready together in one write."""
    batches = Batches(outbox)
    while True:
        msg = await batches.next()
        try:
            await context.write(msg)
        except Exception as exc:  # noqa: BLE001 - the stream is gone; the reader ends it
            log_event("transfers.write_failed", logging.DEBUG, transfer_id=msg.transfer_id, detail=repr(exc))


class _OffererStream:
    """One transfer on a ``Transfers`` stream, as the offering side's handoff sees it."""

    def __init__(self, transfer_id: str, outbox: asyncio.Queue[peer_pb2.TransferServerMessage]) -> None:
        self.transfer_id = transfer_id
        #: The loop time the transfer's deadline passes (set once its start is checked).
        self.ends_at = float("inf")
        self.inbox: asyncio.Queue[peer_pb2.TransferDone | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self._outbox = outbox
        self._gone = False
        self._callbacks: list[Callable[[], None]] = []

    def leave(self) -> None:
        """The puller left (abort, or the stream's end): wake the serving task up, once."""
        if self._gone:
            return
        self._gone = True
        self.inbox.put_nowait(None)
        for callback in self._callbacks:
            callback()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def puller_gone(self) -> bool:
        return self._gone

    def on_puller_gone(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def time_remaining(self) -> float | None:
        return self.ends_at - asyncio.get_running_loop().time()

    async def send_headers(self) -> None:
        return None  # the stream is open already

    def _send(self, **msg: Any) -> None:
        self._outbox.put_nowait(peer_pb2.TransferServerMessage(transfer_id=self.transfer_id, **msg))

    async def accepted(self, accepted: peer_pb2.TransferAccepted) -> None:
        self._send(accepted=accepted)

    async def ready(self, layers: int) -> None:
        self._send(ready=peer_pb2.TransferReady(layers=layers))

    async def sent(self, nbytes: int, transport: str, sums: peer_pb2.BlockSums | None = None) -> None:
        self._send(sent=peer_pb2.TransferSent(bytes=nbytes, transport=transport, sums=sums))

    async def read_done(self) -> tuple[bool, str, int] | None:
        done = await self.inbox.get()
        if done is None:
            return None
        return bool(done.ok), str(done.detail), max(1, int(done.readers))

    async def closed(self) -> None:
        self._send(closed=peer_pb2.TransferClosed(released=True))
