"""An engine's session with its node's daemon: the channel, the event stream that is the
session (the daemon deregisters its pools when it ends), the call stream, and getting the
session back after the daemon restarted (:meth:`SessionClient.reconnect`, or by itself with
``auto_reconnect``). :class:`~._client.AsyncKvxferClient` builds on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Self

import grpc

from kvxfer.defaults import channel_options, default_socket_path
from kvxfer.errors import DeadlineExceededError, KvxferError, UnavailableError, error_from_rpc
from kvxfer.proto import engine_pb2, engine_pb2_grpc

from ._call_stream import CallStream, CallStreamUnsupportedError
from ._config import call_stream_enabled
from ._events import event_from_proto
from ._inbox import Inbox

__all__ = ["SessionClient"]


class SessionClient:
    """The session half of the client (see :class:`~._client.AsyncKvxferClient`)."""

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        engine_name: str = "",
        timeout_s: float = 30.0,
        call_stream: bool | None = None,
        auto_reconnect: bool = False,
        logger: logging.Logger | None = None,
    ) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.auto_reconnect = auto_reconnect
        self.log = logger or logging.getLogger("kvxfer_client")
        #: Sessions opened again after one was lost (by :meth:`reconnect` or automatically).
        self.reconnects = 0
        #: ``time.monotonic()`` when the daemon last ended a session (0: never; a session this
        #: client closed does not count), and when this client's pools were last registered
        #: again after one was (0: never): other processes of the engine compare them (the
        #: clock is the host's).
        self.lost_at = 0.0
        self.restored_at = 0.0
        self._reconnecting: asyncio.Task[None] | None = None
        self._reconnect_lock = asyncio.Lock()
        self._closed = False
        self.engine_name = engine_name
        self.timeout_s = timeout_s
        self.call_stream = call_stream_enabled() if call_stream is None else call_stream
        self.session_id = ""
        self.daemon_id = ""
        #: Where peers reach the daemon (tickets name it); from the session's first event.
        self.peer_address = ""
        self._channel: grpc.aio.Channel | None = None
        self._stub: engine_pb2_grpc.EngineServiceStub | None = None
        self._calls: CallStream | None = None
        self._inbox = Inbox()
        self._reader: asyncio.Task[None] | None = None
        self._session_lost: KvxferError | None = None
        self._setup()

    def _setup(self) -> None:
        """The state each layer of the client adds (pools, layer marks), made once here so
        that the constructor's signature is written once."""

    async def connect(self) -> Self:
        """Open the channel and the event stream (the session); idempotent."""
        if self._stub is not None:
            return self
        self._closed = False
        self._channel = grpc.aio.insecure_channel(f"unix:{self.socket_path}", options=channel_options())
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._calls = CallStream(self._stub) if self.call_stream else None
        stream = self._stub.WatchEvents(engine_pb2.WatchEventsRequest(engine_name=self.engine_name))
        try:
            first = await asyncio.wait_for(stream.read(), self.timeout_s)
        except TimeoutError:
            await self._disconnect()
            raise DeadlineExceededError(f"no session from kvxferd at {self.socket_path}") from None
        except grpc.RpcError as exc:
            await self._disconnect()
            err = error_from_rpc(exc)
            raise type(err)(f"cannot reach kvxferd at {self.socket_path}: {err}") from None
        if first is grpc.aio.EOF or first.WhichOneof("event") != "session_started":
            await self._disconnect()
            raise UnavailableError("kvxferd did not start a session")
        self.session_id = first.session_started.session_id
        self.daemon_id = first.session_started.daemon_id
        self.peer_address = first.session_started.peer_address
        self._session_lost = None
        self._reader = asyncio.create_task(self._read_events(stream))
        return self

    @property
    def connected(self) -> bool:
        """True while this client holds a live session with the daemon."""
        return self._stub is not None and self._session_lost is None

    async def reconnect(self) -> Self:
        """Open a new session (after the daemon restarted, say) and register every pool of
        this client again from the memory it already has, under the pool ids and offer keys it
        had (other sessions of the engine may hold them); each :class:`Pool` keeps working."""
        async with self._reconnect_lock:
            await self._disconnect()
            await self.connect()
            await self._restore()
            self.reconnects += 1
            self.restored_at = time.monotonic()
        return self

    async def _ready(self) -> None:
        """Connect on first use; after a lost session, wait for the reconnection (up to
        ``timeout_s``) when ``auto_reconnect``."""
        if self._stub is None and (not self.session_id or not self.auto_reconnect):
            await self.connect()  # first use (or, without auto_reconnect, after close)
        elif self.auto_reconnect and (self._stub is None or self._session_lost is not None):
            task = self._reconnecting
            if task is None or task.done():
                task = self._reconnecting = asyncio.create_task(self._reconnect_until_back())
            try:
                await asyncio.wait_for(asyncio.shield(task), self.timeout_s)
            except TimeoutError:
                raise UnavailableError(
                    f"kvxferd at {self.socket_path} has been away for over {self.timeout_s:.0f}s "
                    "(still reconnecting in the background): is the daemon running?"
                ) from None

    async def _reconnect_until_back(self) -> None:
        """``auto_reconnect``: reconnect with backoff until the daemon is back or the client
        closes; logged once when lost and once when back."""
        started, delay, attempts = asyncio.get_running_loop().time(), 0.05, 0
        lost = self._session_lost
        self.log.warning("kvxfer: %s; reconnecting to %s", lost or "no session with kvxferd", self.socket_path)
        while not self._closed:
            attempts += 1
            try:
                await self.reconnect()
            except (Exception, asyncio.CancelledError) as exc:  # whatever failed, the next attempt may not
                task = asyncio.current_task()
                if isinstance(exc, asyncio.CancelledError) and (self._closed or (task and task.cancelling())):
                    raise  # close() stops us; a stray cancellation from within does not
                if not isinstance(exc, KvxferError):
                    self.log.warning("kvxfer: reconnecting to %s failed unexpectedly: %r", self.socket_path, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            self.log.warning(
                "kvxfer: reconnected to kvxferd at %s after %.1fs (%d attempts): new session, %s",
                self.socket_path,
                asyncio.get_running_loop().time() - started,
                attempts,
                self._restored(),
            )
            return

    async def _read_events(self, stream: Any) -> None:
        try:
            while True:
                msg = await stream.read()
                if msg is grpc.aio.EOF:
                    break
                event = event_from_proto(msg)
                if event is not None:
                    self._inbox.take(event)
            self._session_lost = UnavailableError("kvxferd closed the session")
            self.lost_at = time.monotonic()
        except grpc.RpcError as exc:
            self._session_lost = UnavailableError(f"session with kvxferd lost: {error_from_rpc(exc)}")
            self.lost_at = time.monotonic()
        except asyncio.CancelledError:
            self._session_lost = UnavailableError("client closed")
            raise
        finally:
            self._inbox.session_ended(self._session_lost or UnavailableError("session lost"))
            # Lost, not ended by this client (reconnect() holds the lock while it replaces it).
            idle = self._reconnecting is None or self._reconnecting.done()
            if self.auto_reconnect and not self._closed and not self._reconnect_lock.locked() and idle:
                self._reconnecting = asyncio.create_task(self._reconnect_until_back())

    async def close(self) -> None:
        """End the session: the daemon deregisters this client's pools."""
        self._closed = True
        if self._reconnecting is not None and self._reconnecting is not asyncio.current_task():
            self._reconnecting.cancel()
            try:
                await self._reconnecting
            except (asyncio.CancelledError, KvxferError):
                pass
        await self._disconnect()

    async def _disconnect(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
            self._reader = None
        if self._calls is not None:
            await self._calls.close()
            self._calls = None
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None

    async def __aenter__(self) -> Self:
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _call(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        await self._ready()
        if self._session_lost is not None:
            raise self._session_lost
        try:
            return await method(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    async def _hot_call(self, kind: str, unary: Any, request: Any, timeout_s: float | None = None) -> Any:
        """Offer and Pull: on the call stream while the daemon has one, else a unary call."""
        await self._ready()
        if self._calls is not None and not self._calls.unsupported:
            if self._session_lost is not None:
                raise self._session_lost
            try:
                return await self._calls.call(kind, request, timeout_s or self.timeout_s)
            except CallStreamUnsupportedError:
                pass  # an older kvxferd: nothing ran, send it unary
        return await self._call(unary, request, timeout_s)

    @property
    def _engine(self) -> engine_pb2_grpc.EngineServiceStub:
        assert self._stub is not None
        return self._stub

    async def _restore(self) -> None:
        """After a new session: register again what the old one held (see ``_pools``)."""

    def _restored(self) -> str:
        """What :meth:`_restore` registered again, for the log."""
        return "nothing registered again"
