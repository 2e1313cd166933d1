"""The client end of ``EngineService.Calls``: Offer and Pull on one long-lived stream.

A message on an open gRPC stream costs about half a unary call, and these two calls are on
the critical path of time-to-first-token (see ``kvxferd/control/call_stream.py``). The stream
opens on first use. Every request gets a fresh ``call_id`` and a future; one reader task
resolves the futures as answers arrive, in whatever order the daemon finishes the calls.

Each call keeps the deadline its unary twin would have: past it, or when the caller is
cancelled, the call is abandoned (the daemon cancels it) and the caller gets
:class:`DeadlineExceededError` (or its cancellation). A lost stream fails the calls still
waiting with :class:`UnavailableError`; the next call opens a new stream. A daemon without
``Calls`` answers UNIMPLEMENTED, which :class:`CallStreamUnsupportedError` reports so the client
can send that call, and every later one, as unary calls instead.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import grpc

from ._errors import (
    DeadlineExceededError,
    KvxferError,
    UnavailableError,
    error_from_rpc,
    error_from_status,
    status_code,
)
from ._proto import engine_pb2, engine_pb2_grpc

__all__ = ["CallStream", "CallStreamUnsupportedError"]


class CallStreamUnsupportedError(Exception):
    """The daemon has no ``Calls`` method (an older kvxferd): nothing was executed."""


class CallStream:
    """Multiplexes calls over one ``Calls`` stream of ``stub``'s channel."""

    def __init__(self, stub: engine_pb2_grpc.EngineServiceStub) -> None:
        self._stub = stub
        self._ids = itertools.count(1)
        self._call: Any = None  # grpc.aio.StreamStreamCall while open
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[engine_pb2.CallResponse]] = {}
        self._write_lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        #: Set once the daemon answered UNIMPLEMENTED: use unary calls from then on.
        self.unsupported = False

    async def call(self, kind: str, request: Any, timeout_s: float) -> Any:
        """Send ``request`` as a ``kind`` call ("offer" or "pull") and return the daemon's
        response message; raises the :class:`KvxferError` the unary call would have raised."""
        if self.unsupported:
            raise CallStreamUnsupportedError
        call = self._call if self._call is not None else self._open()
        call_id = next(self._ids)
        answered = asyncio.get_running_loop().create_future()
        self._pending[call_id] = answered
        try:
            async with asyncio.timeout(timeout_s):
                async with self._write_lock:
                    await call.write(engine_pb2.CallRequest(call_id=call_id, **{kind: request}))
                response = await answered
        except TimeoutError:
            self._abandon(call, call_id)
            raise DeadlineExceededError(f"kvxferd did not answer the {kind} within {timeout_s:g}s") from None
        except asyncio.CancelledError:
            self._abandon(call, call_id)
            raise
        except grpc.RpcError as exc:  # the write found the stream failed
            raise self._stream_error(exc) from None
        except asyncio.InvalidStateError:  # the write found the stream ended: nothing was sent
            raise (
                CallStreamUnsupportedError if self.unsupported else UnavailableError("call stream to kvxferd ended")
            ) from None
        finally:
            self._pending.pop(call_id, None)
        result = response.WhichOneof("result")
        if result == "error":
            raise error_from_status(status_code(response.error.code), response.error.details)
        if result != kind:
            raise UnavailableError(f"kvxferd answered a {kind} call with {result!r}")
        return getattr(response, kind)

    def _open(self) -> Any:
        call = self._call = self._stub.Calls()
        self._reader = asyncio.create_task(self._read(call), name="kvxfer-calls")
        return call

    async def _read(self, call: Any) -> None:
        error: Exception = UnavailableError("kvxferd closed the call stream")
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                answered = self._pending.get(response.call_id)
                if answered is not None and not answered.done():
                    answered.set_result(response)
        except grpc.RpcError as exc:
            error = self._stream_error(exc)
        except asyncio.CancelledError:
            error = UnavailableError("client closed")
            raise
        finally:
            self._lost(call, error)

    def _stream_error(self, exc: grpc.RpcError) -> Exception:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.unsupported = True
            return CallStreamUnsupportedError()
        err = error_from_rpc(exc)
        return UnavailableError(f"call stream to kvxferd lost: {err}")

    def _lost(self, call: Any, error: Exception) -> None:
        """The stream ended: fail its waiting calls; the next call opens a new stream."""
        if self._call is not call:
            return
        self._call = None
        for answered in self._pending.values():
            if not answered.done():
                answered.set_exception(error)
        self._pending.clear()

    def _abandon(self, call: Any, call_id: int) -> None:
        """Tell the daemon to cancel ``call_id`` (in the background: the caller has moved on)."""

        async def send() -> None:
            try:
                async with self._write_lock:
                    await call.write(engine_pb2.CallRequest(call_id=call_id, abandon=True))
            except (grpc.RpcError, asyncio.InvalidStateError, KvxferError):
                pass  # the stream is gone: the daemon cancelled everything on it already

        if self._call is call:
            task = asyncio.create_task(send())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Cancel the stream (the daemon cancels its running calls) and fail the waiting ones."""
        call, reader = self._call, self._reader
        if call is not None:
            self._lost(call, UnavailableError("client closed"))
            call.cancel()
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, *self._background, return_exceptions=True)
        self._reader = None
