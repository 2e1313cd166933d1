"""The client end of ``EngineService.Calls``: Offer and Pull on one long-lived stream.

A message on an open gRPC stream costs about half a unary call, and these two calls are on
the critical path of time-to-first-token (see ``kvxferd/control/call_stream.py``). The stream
opens on first use. Every request gets a fresh ``call_id`` and a future; one writer task sends
the requests (a caller cancelled halfway through a write would cancel the whole gRPC call), and
one reader task resolves the futures as answers arrive, in whatever order the daemon finishes
the calls.

Each call keeps the deadline its unary twin would have: past it, or when the caller is
cancelled, the call is abandoned (the daemon cancels it) and the caller gets
:class:`DeadlineExceededError` (or its cancellation). A lost stream fails the calls still
waiting with :class:`UnavailableError`; the next call opens a new stream. A daemon without
``Calls`` answers UNIMPLEMENTED, which :class:`CallStreamUnsupportedError` reports so the client
can send that call, and every later one, as unary calls instead.

Calls queued together go in one write (``more``, :mod:`kvxfer.batching`) once the daemon's
initial metadata said it reads them; the stream is opened saying this end reads batched
answers. With 64 calls in flight that is one trip through grpc.aio's poller instead of 64.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvxfer.batching import CALL_BATCHES, Batches, unbatched
from kvxfer.errors import (
    DeadlineExceededError,
    UnavailableError,
    error_from_rpc,
    error_from_status,
    status_code,
)
from kvxfer.proto import engine_pb2, engine_pb2_grpc

__all__ = ["CallStream", "CallStreamUnsupportedError"]


class CallStreamUnsupportedError(Exception):
    """The daemon has no ``Calls`` method (an older kvxferd): nothing was executed."""


@dataclass
class _Stream:
    """One open ``Calls`` stream: the gRPC call, its reader and writer tasks, and the requests
    waiting to be written."""

    call: Any  # grpc.aio.StreamStreamCall
    outbox: asyncio.Queue[engine_pb2.CallRequest] = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    #: The daemon said it reads calls batched in ``more`` (its initial metadata).
    batched: bool = False


class CallStream:
    """Multiplexes calls over one ``Calls`` stream of ``stub``'s channel."""

    def __init__(self, stub: engine_pb2_grpc.EngineServiceStub) -> None:
        self._stub = stub
        self._ids = itertools.count(1)
        self._stream: _Stream | None = None
        self._pending: dict[int, asyncio.Future[engine_pb2.CallResponse]] = {}
        #: Set once the daemon answered UNIMPLEMENTED: use unary calls from then on.
        self.unsupported = False

    async def call(self, kind: str, request: Any, timeout_s: float) -> Any:
        """Send ``request`` as a ``kind`` call ("offer" or "pull") and return the daemon's
        response message; raises the :class:`KvxferError` the unary call would have raised."""
        if self.unsupported:
            raise CallStreamUnsupportedError
        stream = self._stream if self._stream is not None else self._open()
        call_id = next(self._ids)
        answered = asyncio.get_running_loop().create_future()
        self._pending[call_id] = answered
        # The writer task sends it: a caller cancelled halfway through a write would cancel
        # the whole gRPC call, and with it every other call on the stream.
        stream.outbox.put_nowait(engine_pb2.CallRequest(call_id=call_id, **{kind: request}))
        try:
            async with asyncio.timeout(timeout_s):
                response = await answered
        except TimeoutError:
            self._abandon(stream, call_id)
            raise DeadlineExceededError(f"kvxferd did not answer the {kind} within {timeout_s:g}s") from None
        except asyncio.CancelledError:
            self._abandon(stream, call_id)
            raise
        finally:
            self._pending.pop(call_id, None)
        result = response.WhichOneof("result")
        if result == "error":
            e = response.error
            raise error_from_status(
                status_code(e.code),
                e.details,
                transfer_id=e.transfer_id,
                offer_id=e.offer_id,
                may_still_write=e.may_still_write,
                reason=e.reason,
            )
        if result != kind:
            raise UnavailableError(f"kvxferd answered a {kind} call with {result!r}")
        return getattr(response, kind)

    def _open(self) -> _Stream:
        stream = self._stream = _Stream(self._stub.Calls(metadata=(CALL_BATCHES,)))
        stream.tasks += [
            asyncio.create_task(self._read(stream), name="kvxfer-calls-reader"),
            asyncio.create_task(self._write(stream), name="kvxfer-calls-writer"),
        ]
        return stream

    async def _write(self, stream: _Stream) -> None:
        batches = Batches(stream.outbox)
        try:
            while True:
                await stream.call.write(await (batches.next() if stream.batched else stream.outbox.get()))
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the stream ended: its reader fails the waiting calls

    async def _read(self, stream: _Stream) -> None:
        error: Exception = UnavailableError("kvxferd closed the call stream")
        try:
            # A daemon sends its initial metadata when it starts serving the stream (an older
            # one with its first answer): until then, calls go one a write.
            stream.batched = CALL_BATCHES in tuple(await stream.call.initial_metadata() or ())
            while (batch := await stream.call.read()) is not grpc.aio.EOF:
                for response in unbatched(batch):
                    answered = self._pending.get(response.call_id)
                    if answered is not None and not answered.done():
                        answered.set_result(response)
                await asyncio.sleep(0)  # the callers answered go on before the next read is asked for
        except grpc.RpcError as exc:
            error = self._stream_error(exc)
        except asyncio.CancelledError:
            error = UnavailableError("client closed")
            raise
        finally:
            self._lost(stream, error)

    def _stream_error(self, exc: grpc.RpcError) -> Exception:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.unsupported = True
            return CallStreamUnsupportedError()
        err = error_from_rpc(exc)
        return UnavailableError(f"call stream to kvxferd lost: {err}")

    def _lost(self, stream: _Stream, error: Exception) -> None:
        """The stream ended: fail its waiting calls; the next call opens a new stream."""
        if self._stream is not stream:
            return
        self._stream = None
        for task in stream.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        for answered in self._pending.values():
            if not answered.done():
                answered.set_exception(error)
        self._pending.clear()

    def _abandon(self, stream: _Stream, call_id: int) -> None:
        """Tell the daemon to cancel ``call_id``: the caller has moved on."""
        if self._stream is stream:
            stream.outbox.put_nowait(engine_pb2.CallRequest(call_id=call_id, abandon=True))

    async def close(self) -> None:
        """Cancel the stream (the daemon cancels its running calls) and fail the waiting ones."""
        stream = self._stream
        if stream is not None:
            self._lost(stream, UnavailableError("client closed"))
            stream.call.cancel()
            await asyncio.gather(*stream.tasks, return_exceptions=True)
