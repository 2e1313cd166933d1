"""The engine-facing SDK: :class:`AsyncKvxferClient` (its blocking twin is ``_blocking``).

An engine opens one client per process; the client holds an event stream that is also the
engine's session with the daemon (pools die with it).

>>> async def prefill_side():                                     # doctest: +SKIP
...     async with AsyncKvxferClient(engine_name="prefill") as client:
...         pool = await client.register_pool([HostBuffer.create(1 << 20)],
...                                           Layout.contiguous(num_blocks=16, block_bytes=65536))
...         ticket = await client.offer(pool, [3, 1, 4])
...         return ticket.to_json()
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from ._buffers import buffer_spec
from ._call_stream import CallStream, CallStreamUnsupportedError
from ._config import call_stream_enabled, channel_options, default_socket_path
from ._errors import (
    DeadlineExceededError,
    InvalidRequestError,
    KvxferError,
    UnavailableError,
    error_from_rpc,
)
from ._events import LayersLanded, OfferReleased, TransferFailed, event_from_proto
from ._fds import attach_process, pass_fds
from ._host_tensor import allow_daemon
from ._layout import MAX_BLOCKS, Layout
from ._marks import LayerMarks
from ._memory import HostBuffer
from ._proto import common_pb2, engine_pb2, engine_pb2_grpc
from ._results import CancelResult, Pool, PullResult, PushResult, pull_result
from ._ticket import Ticket
from ._tier import TierCalls

__all__ = ["AsyncKvxferClient"]

T = TypeVar("T")
Event = OfferReleased | TransferFailed
_RELEASED_MEMORY = 100_000  # released events kept for late wait_released() calls
_LANDED_MEMORY = 10_000  # layer-wise transfers whose landed layers are remembered
#: Events kept for events()/next_event(); past it the oldest go (counted in events_dropped),
#: so an engine that only calls wait_released() holds a bounded amount.
MAX_QUEUED_EVENTS = 10_000
#: Seconds a pull's RPC may outlast its ``timeout_s``. After the deadline the daemon cancels
#: the receives and waits up to 5 s (``kvxferd``'s ``CANCEL_CONFIRM_S``) for UCX to confirm
#: that nothing more will be written; its answer then carries ``may_still_write``, which the
#: engine needs before it reuses the destination blocks. A shorter margin would end the call
#: first, with a bare deadline error and without that flag.
PULL_ANSWER_MARGIN_S = 10.0


def _block_ids(block_ids: Sequence[int] | np.ndarray[Any, Any], what: str) -> list[int]:
    arr = np.asarray(block_ids)
    if arr.ndim != 1 or arr.size == 0:
        raise InvalidRequestError(f"{what} must be a non-empty 1-D list of block ids")
    if arr.dtype.kind not in "iu":
        raise InvalidRequestError(f"{what} must be integers, got {arr.dtype}")
    if arr.size > MAX_BLOCKS or int(arr.min()) < 0 or int(arr.max()) >= MAX_BLOCKS:
        raise InvalidRequestError(f"{what}: block ids must be in 0..{MAX_BLOCKS - 1}")
    ids: list[int] = arr.astype(np.int64).tolist()
    return ids


def _as_ticket(ticket: Ticket | str | dict[str, Any]) -> Ticket:
    if isinstance(ticket, str):
        return Ticket.from_json(ticket)
    if isinstance(ticket, dict):
        return Ticket.from_dict(ticket)
    return ticket


class AsyncKvxferClient(TierCalls):
    """Asyncio client of the node's kvxferd, over its Unix socket.

    ``socket_path`` defaults to :func:`kvxfer_client.default_socket_path`; ``timeout_s``
    bounds every call except :meth:`pull`, which has its own ``timeout_s``. ``call_stream``
    (default: ``$KVXFER_CALL_STREAM``, on) sends :meth:`offer` and :meth:`pull` on one
    long-lived gRPC stream instead of as unary calls, which halves their gRPC cost; the
    results and errors are the same either way.

    When the daemon restarts, the session ends: calls raise :class:`UnavailableError` until
    :meth:`reconnect`, which opens a new session and registers the client's pools again
    (same memory, same :class:`Pool` objects). With ``auto_reconnect`` the next call does
    that itself, retrying with backoff for up to ``timeout_s``. Offers and tickets of the old
    daemon died with it: a pull of one raises :class:`NotFoundError`.
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        engine_name: str = "",
        timeout_s: float = 30.0,
        call_stream: bool | None = None,
        auto_reconnect: bool = False,
    ) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.auto_reconnect = auto_reconnect
        self.engine_name = engine_name
        self.timeout_s = timeout_s
        self.call_stream = call_stream_enabled() if call_stream is None else call_stream
        self.session_id = ""
        self.daemon_id = ""
        #: Where peers reach the daemon (tickets name it); from the session's first event.
        self.peer_address = ""
        self._marks = LayerMarks(self._send_layers_ready)
        self._channel: grpc.aio.Channel | None = None
        self._stub: engine_pb2_grpc.EngineServiceStub | None = None
        self._calls: CallStream | None = None
        self._events: asyncio.Queue[Event] = asyncio.Queue(MAX_QUEUED_EVENTS)
        #: Events dropped, oldest first, because nobody read them (see MAX_QUEUED_EVENTS).
        self.events_dropped = 0
        self._released: dict[str, OfferReleased] = {}
        #: Layers landed per layer-wise transfer into this session's pools (LayersLanded).
        self._landed: dict[str, int] = {}
        self._landed_changed = asyncio.Event()
        self._waiters: dict[str, asyncio.Future[OfferReleased]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._session_lost: KvxferError | None = None
        #: Registered pools, registered again by :meth:`reconnect`.
        self._pools: list[Pool] = []
        #: The session this process is attached to (its CPU tensors can be registered).
        self._attached_session = ""

    async def connect(self) -> AsyncKvxferClient:
        """Open the channel and the event stream (the session); idempotent."""
        if self._stub is not None:
            return self
        self._channel = grpc.aio.insecure_channel(f"unix:{self.socket_path}", options=channel_options())
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._calls = CallStream(self._stub) if self.call_stream else None
        stream = self._stub.WatchEvents(engine_pb2.WatchEventsRequest(engine_name=self.engine_name))
        try:
            first = await asyncio.wait_for(stream.read(), self.timeout_s)
        except TimeoutError:
            await self.close()
            raise DeadlineExceededError(f"no session from kvxferd at {self.socket_path}") from None
        except grpc.RpcError as exc:
            await self.close()
            err = error_from_rpc(exc)
            raise type(err)(f"cannot reach kvxferd at {self.socket_path}: {err}") from None
        if first is grpc.aio.EOF or first.WhichOneof("event") != "session_started":
            await self.close()
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

    async def reconnect(self) -> AsyncKvxferClient:
        """Open a new session (after the daemon restarted, say) and register every pool of
        this client again from the memory it already has; each :class:`Pool` keeps working."""
        await self.close()
        await self.connect()
        for pool in self._pools:
            fresh = await self._register(list(pool.buffers), pool.layout, pool.name)
            pool.pool_id, pool.fingerprint = fresh.pool_id, fresh.fingerprint
        return self

    async def _ready(self) -> None:
        """Connect on first use; after a lost session, reconnect when ``auto_reconnect``."""
        if self._stub is None:
            await self.connect()
        elif self._session_lost is not None and self.auto_reconnect:
            delay, deadline = 0.05, asyncio.get_running_loop().time() + self.timeout_s
            while True:
                try:
                    await self.reconnect()
                    return
                except (UnavailableError, DeadlineExceededError):
                    if asyncio.get_running_loop().time() + delay > deadline:
                        raise
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)

    async def _read_events(self, stream: Any) -> None:
        try:
            while True:
                msg = await stream.read()
                if msg is grpc.aio.EOF:
                    break
                event = event_from_proto(msg)
                if event is None:
                    continue
                if isinstance(event, LayersLanded):
                    self._layers_landed(event)  # many per transfer: kept out of events()
                    continue
                if isinstance(event, OfferReleased):
                    # Kept even when someone waits: a waiter that gave up (its timeout) and
                    # asks again must still hear of it.
                    if len(self._released) >= _RELEASED_MEMORY:
                        self._released.pop(next(iter(self._released)))
                    self._released[event.offer_id] = event
                    waiter = self._waiters.pop(event.offer_id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(event)
                if self._events.full():
                    self._events.get_nowait()
                    self.events_dropped += 1
                self._events.put_nowait(event)
            self._session_lost = UnavailableError("kvxferd closed the session")
        except grpc.RpcError as exc:
            self._session_lost = UnavailableError(f"session with kvxferd lost: {error_from_rpc(exc)}")
        except asyncio.CancelledError:
            self._session_lost = UnavailableError("client closed")
            raise
        finally:
            for waiter in self._waiters.values():
                if not waiter.done():
                    waiter.set_exception(self._session_lost or UnavailableError("session lost"))
            self._waiters.clear()
            self._landed_changed.set()  # wait_layers() then sees the session lost

    async def close(self) -> None:
        """End the session: the daemon deregisters this client's pools."""
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

    async def __aenter__(self) -> AsyncKvxferClient:
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

    async def register_pool(self, buffers: Sequence[Any], layout: Layout, *, name: str = "") -> Pool:
        """Register buffers and their layout; the daemon maps them.

        ``buffers`` are all of one kind: :class:`HostBuffer` (POSIX shared memory); CPU tensors
        this process owns (numpy arrays, torch CPU tensors: ``__array_interface__`` or DLPack;
        contiguous and writable; the daemon reaches them through the kernel, see
        ``kvxfer_client._host_tensor``); or GPU tensors of one GPU (``__cuda_array_interface__``
        or DLPack: torch, CuPy, ...; contiguous, allocated with ``cudaMalloc`` so that a legacy
        CUDA IPC handle exists).
        Several buffers per pool are normal (vLLM keeps one tensor per layer). The engine
        keeps tensors alive until the pool is deregistered, and offers blocks only after
        the stream that wrote them has been synchronised.

        Host buffers go to the daemon as open file descriptors (never names), so the daemon
        maps only memory this engine can open; the same buffers may be registered again, e.g.
        after the daemon restarted.
        """
        await self._ready()
        pool = await self._register(buffers, layout, name)
        self._pools.append(pool)
        return pool

    async def _register(self, buffers: Sequence[Any], layout: Layout, name: str) -> Pool:
        if not buffers:
            raise InvalidRequestError("a pool needs at least one buffer")
        specs = [buffer_spec(b) for b in buffers]
        layout.validate([s.size for s in specs])
        host = [i for i, b in enumerate(buffers) if isinstance(b, HostBuffer)]
        if host:
            fds = [buffers[i].fd for i in host]
            if min(fds) < 0:
                raise InvalidRequestError("host buffers must come from HostBuffer.create (they pass their descriptor)")
            handles = await asyncio.to_thread(pass_fds, self.socket_path + ".fds", self.session_id, fds, self.timeout_s)
            for i, handle in zip(host, handles, strict=True):
                specs[i].fd_handle = handle
        if any(s.kind == common_pb2.MEMORY_KIND_HOST_PROCESS for s in specs):
            await self._attach_process()
        req = engine_pb2.RegisterPoolRequest(
            session_id=self.session_id, buffers=specs, layout=layout.to_proto(), name=name
        )
        resp = await self._call(self._engine.RegisterPool, req)
        return Pool(resp.pool_id, layout, tuple(buffers), resp.fingerprint, name, bytes(resp.offer_key))

    async def _attach_process(self) -> None:
        """Attach this process to the session (once per session) so the daemon may reach the
        memory of its CPU tensors, and let it past Yama where that is on."""
        if self._attached_session == self.session_id:
            return
        path = self.socket_path + ".fds"
        daemon_pid = await asyncio.to_thread(attach_process, path, self.session_id, self.timeout_s)
        allow_daemon(daemon_pid)
        self._attached_session = self.session_id

    async def deregister_pool(self, pool: Pool | str) -> int:
        """Deregister a pool; returns how many of its offers were released."""
        await self._ready()
        pool_id = pool.pool_id if isinstance(pool, Pool) else pool
        self._pools = [p for p in self._pools if p.pool_id != pool_id]
        req = engine_pb2.DeregisterPoolRequest(pool_id=pool_id, session_id=self.session_id)
        resp = await self._call(self._engine.DeregisterPool, req)
        return int(resp.released_offers)

    async def offer(
        self,
        pool: Pool | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        *,
        lease_s: float = 0.0,
        ticket: Ticket | None = None,
        offer_key: bytes = b"",
        readers: int | None = None,
        layers: int = 0,
    ) -> Ticket:
        """Pin blocks for a decode engine and return the ticket to hand it.

        ``ticket``: one made in advance by :meth:`new_ticket` (and perhaps handed out
        already); the offer is made under its id and token. ``offer_key``: the pool's
        (``Pool.offer_key``) when it is another session's of this engine, e.g. a vLLM worker's
        pool offered from the scheduler process. ``readers``: how many pulls the offer serves
        before it is released (decode ranks that each take their heads; default the ticket's,
        else one). ``layers``: the blocks are still being written, one layer after the other
        (the layout's regions in that many equal groups); say how far with
        :meth:`layers_ready`, and pulls move each layer once written.
        """
        await self._ready()
        pool_id = pool.pool_id if isinstance(pool, Pool) else pool
        ids = _block_ids(block_ids, "block_ids")
        req = engine_pb2.OfferRequest(
            pool_id=pool_id,
            block_ids=ids,
            lease_s=lease_s,
            session_id=self.session_id,
            offer_key=offer_key,
            readers=readers if readers is not None else (ticket.readers if ticket is not None else 1),
            layers=layers,
        )
        if ticket is not None:
            if ticket.num_blocks != len(ids):
                raise InvalidRequestError(f"the ticket is for {ticket.num_blocks} blocks, {len(ids)} given")
            req.offer_id, req.token = ticket.offer_id, ticket.token
        resp = await self._hot_call("offer", self._engine.Offer, req)
        return Ticket.from_proto(resp.ticket)

    def new_ticket(self, pool: Pool, num_blocks: int, readers: int = 1) -> Ticket:
        """A ticket for an offer of ``num_blocks`` blocks of ``pool`` not made yet: no round trip
        to the daemon. Hand it out at once and make the offer with ``offer(..., ticket=...)``
        soon; a pull that arrives first waits for the offer (the daemon's ``offer_wait_s``).
        For a scheduler that must answer before its worker can offer (vLLM's
        ``request_finished``)."""
        if not self.daemon_id:
            raise UnavailableError("not connected: connect() first (the ticket names the daemon)")
        return Ticket.in_advance(
            self.daemon_id, self.peer_address, pool.fingerprint, num_blocks, pool.layout.bytes_per_block, readers
        )

    async def pull(
        self,
        ticket: Ticket | str | dict[str, Any],
        pool: Pool | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        *,
        transfer_id: str = "",
        timeout_s: float = 60.0,
        offer_block_indices: Sequence[int] | np.ndarray[Any, Any] | None = None,
    ) -> PullResult:
        """Copy the ticket's blocks into ``block_ids`` of ``pool``; returns once they landed.

        ``offer_block_indices``: pull only the ticket's blocks at these positions of its list
        (e.g. ``range(k, n)`` when the first ``k`` are already in this engine's prefix cache),
        one destination id each. The offer is released as pulled either way.

        Past ``timeout_s`` the pull fails with :class:`DeadlineExceededError`, at most a few
        seconds later: the daemon first makes sure UCX writes no more into the destination,
        and sets ``may_still_write`` on the error when it could not.
        """
        ticket = _as_ticket(ticket)
        ids = _block_ids(block_ids, "dst block_ids")
        indices = [] if offer_block_indices is None else _block_ids(offer_block_indices, "offer_block_indices")
        # With a declared geometry, block counts may differ (other block sizes): the daemon checks.
        counted = not (isinstance(pool, Pool) and pool.layout.geometry is not None)
        if counted and offer_block_indices is None and len(ids) != ticket.num_blocks:
            raise InvalidRequestError(f"the ticket holds {ticket.num_blocks} blocks, {len(ids)} destination ids given")
        if counted and offer_block_indices is not None and len(ids) != len(indices):
            raise InvalidRequestError(
                f"the pull moves {len(indices)} of the ticket's blocks, {len(ids)} destination ids given"
            )
        if indices and max(indices) >= ticket.num_blocks:
            raise InvalidRequestError(f"offer_block_indices reach {max(indices)}; the ticket holds {ticket.num_blocks}")
        await self._ready()
        pool_id = pool.pool_id if isinstance(pool, Pool) else pool
        req = engine_pb2.PullRequest(
            ticket=ticket.to_proto(),
            pool_id=pool_id,
            block_ids=ids,
            transfer_id=transfer_id,
            timeout_s=timeout_s,
            session_id=self.session_id,
            offer_block_indices=indices,
        )
        # The daemon enforces timeout_s; the RPC deadline leaves it room to say why it failed
        # and whether the destination may still be written (see PULL_ANSWER_MARGIN_S).
        resp = await self._hot_call("pull", self._engine.Pull, req, timeout_s=timeout_s + PULL_ANSWER_MARGIN_S)
        return pull_result(resp)

    async def push(
        self,
        pool: Pool | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        transfer_id: str,
        to_peer_address: str,
        *,
        lease_s: float = 0.0,
        offer_key: bytes = b"",
        layers: int = 0,
    ) -> PushResult:
        """Offer blocks to the decode engine that expects ``transfer_id`` (its :meth:`receive`)
        on the daemon at ``to_peer_address`` (that engine's ``peer_address``): its daemon moves
        them as soon as both sides are there, with no ticket to hand over.

        ``transfer_id``: the router's, unguessable (e.g. 128 random bits), or the receiver
        names this daemon (``from_daemon_id``). Returns once the push is announced; the release
        event (``pulled``, ``failed``, ``expired``) says how it ended. Where the decode daemon
        could not take it, ``mode`` is ``"pull"`` and ``mode_reason`` says why: hand
        ``ticket`` over to be pulled instead. ``layers``: as for :meth:`offer`.
        """
        await self._ready()
        offer = engine_pb2.OfferRequest(
            pool_id=pool.pool_id if isinstance(pool, Pool) else pool,
            block_ids=_block_ids(block_ids, "block_ids"),
            lease_s=lease_s,
            session_id=self.session_id,
            offer_key=offer_key,
            layers=layers,
        )
        req = engine_pb2.PushRequest(offer=offer, transfer_id=transfer_id, to_peer_address=to_peer_address)
        resp = await self._hot_call("push", self._engine.Push, req)
        return PushResult(Ticket.from_proto(resp.ticket), resp.mode, resp.mode_reason)

    async def layers_ready(
        self, offers: Sequence[Ticket | str] | Ticket | str, layers: int, *, offer_key: bytes = b""
    ) -> None:
        """Say that the first ``layers`` layers of these layer-wise offers (tickets or offer
        ids) are written, e.g. after each layer (group) of a prefill step, for all its requests
        at once. Saying less than before changes nothing."""
        many = offers if isinstance(offers, Sequence) and not isinstance(offers, str) else [offers]
        ids = tuple(o.offer_id if isinstance(o, Ticket) else o for o in many)
        # Marks of the same offers coalesce while one is on its way (see ``_marks``).
        await self._marks.mark((offer_key, ids), layers)

    async def _send_layers_ready(self, key: Hashable, layers: int) -> None:
        assert isinstance(key, tuple)
        offer_key: bytes = key[0]
        ids: tuple[str, ...] = key[1]
        req = engine_pb2.LayersReadyRequest(
            session_id=self.session_id, offer_ids=ids, layers=layers, offer_key=offer_key
        )
        await self._hot_call("layers_ready", self._engine.LayersReady, req)

    async def receive(
        self,
        transfer_id: str,
        pool: Pool | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        *,
        timeout_s: float = 60.0,
        from_daemon_id: str = "",
        offer_block_indices: Sequence[int] | np.ndarray[Any, Any] | None = None,
    ) -> PullResult:
        """Expect the push of ``transfer_id`` into ``block_ids`` of ``pool``; returns once the
        bytes landed, as :meth:`pull` does (same result, same errors).

        The wait for the push and the move share ``timeout_s``; a push that never comes fails
        with :class:`DeadlineExceededError` naming it. ``from_daemon_id``: accept the push only
        from that daemon. ``offer_block_indices``: as for :meth:`pull`, positions in the
        pushed block list (one destination id each). :meth:`cancel` with the transfer id stops
        the wait.
        """
        ids = _block_ids(block_ids, "dst block_ids")
        indices = [] if offer_block_indices is None else _block_ids(offer_block_indices, "offer_block_indices")
        if offer_block_indices is not None and len(indices) != len(ids):
            raise InvalidRequestError(f"{len(indices)} offer_block_indices, {len(ids)} destination ids given")
        await self._ready()
        req = engine_pb2.ReceiveRequest(
            transfer_id=transfer_id,
            pool_id=pool.pool_id if isinstance(pool, Pool) else pool,
            block_ids=ids,
            timeout_s=timeout_s,
            session_id=self.session_id,
            from_daemon_id=from_daemon_id,
            offer_block_indices=indices,
        )
        resp = await self._hot_call("receive", self._engine.Receive, req, timeout_s=timeout_s + PULL_ANSWER_MARGIN_S)
        return pull_result(resp)

    async def release(self, offer_id: str) -> None:
        """Withdraw an offer nobody pulled yet (the engine gets a ``cancelled`` release)."""
        await self._call(self._engine.Release, engine_pb2.ReleaseRequest(offer_id=offer_id, session_id=self.session_id))

    async def cancel(self, transfer_id: str) -> CancelResult:
        """Cancel a running transfer (a pull of this daemon, or a peer's pull of one of its offers).

        Returns once the data plane stopped; ``may_still_write`` says when UCX has not confirmed
        that: keep the destination blocks out of use until the pool is deregistered.
        """
        req = engine_pb2.CancelRequest(transfer_id=transfer_id, session_id=self.session_id)
        resp = await self._call(self._engine.Cancel, req)
        return CancelResult(bool(resp.cancelled), bool(resp.may_still_write))

    async def extend_lease(self, ticket: Ticket | str | dict[str, Any], lease_s: float) -> float:
        """Heartbeat from the decode side: keep an offer alive ``lease_s`` more seconds while
        its request waits (on whichever daemon made it). Returns the seconds left."""
        ticket = _as_ticket(ticket)
        req = engine_pb2.ExtendLeaseRequest(ticket=ticket.to_proto(), lease_s=lease_s)
        resp = await self._call(self._engine.ExtendLease, req)
        return float(resp.lease_remaining_s)

    async def next_event(self, timeout_s: float | None = None) -> Event:
        """The next event of this session (released offers, failed transfers)."""
        try:
            return await asyncio.wait_for(self._events.get(), timeout_s)
        except TimeoutError:
            raise DeadlineExceededError("no event before the deadline") from None

    async def events(self) -> AsyncIterator[Event]:
        """Iterate over this session's events until it ends."""
        while (self._reader is not None and not self._reader.done()) or not self._events.empty():
            yield await self._events.get()

    def _layers_landed(self, event: LayersLanded) -> None:
        if len(self._landed) >= _LANDED_MEMORY and event.transfer_id not in self._landed:
            self._landed.pop(next(iter(self._landed)))
        self._landed[event.transfer_id] = max(self._landed.get(event.transfer_id, 0), event.layers)
        changed, self._landed_changed = self._landed_changed, asyncio.Event()
        changed.set()

    async def wait_layers(self, transfer_id: str, layers: int, timeout_s: float | None = None) -> int:
        """Wait until the first ``layers`` layers of a layer-wise transfer into this engine's
        pool (its pull or receive, under ``transfer_id``) have landed; returns how many have.
        The pull's own answer still says when the whole transfer has (and whether it failed):
        a layer that landed belongs to a transfer that may yet fail."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._landed.get(transfer_id, 0) < layers:
                    if self._session_lost is not None:
                        raise self._session_lost
                    await self._landed_changed.wait()
        except TimeoutError:
            raise DeadlineExceededError(f"{layers} layers of transfer {transfer_id} did not land in time") from None
        return self._landed[transfer_id]

    async def wait_released(self, offer_id: str, timeout_s: float | None = None) -> OfferReleased:
        """Wait until the daemon releases ``offer_id`` and return why."""
        if offer_id in self._released:
            return self._released.pop(offer_id)
        if self._session_lost is not None:
            raise self._session_lost
        fut = self._waiters.setdefault(offer_id, asyncio.get_running_loop().create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            raise DeadlineExceededError(f"offer {offer_id} was not released in time") from None
