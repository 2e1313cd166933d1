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

from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

import numpy as np

from kvxfer.errors import (
    InvalidRequestError,
    UnavailableError,
)
from kvxfer.layout import MAX_BLOCKS
from kvxfer.proto import engine_pb2
from kvxfer.ticket import Ticket

from ._events import OfferReleased
from ._inbox import MAX_QUEUED_EVENTS, Event
from ._marks import LayerMarks
from ._pools import PoolClient
from ._results import CancelResult, Pool, PoolRef, PullResult, PushResult, pool_target, pull_result
from ._tier import TierCalls

__all__ = ["MAX_QUEUED_EVENTS", "AsyncKvxferClient", "Event"]

#: Seconds a pull's RPC may outlast its ``timeout_s``. After the deadline the daemon cancels
#: the receives and waits up to 5 s (``kvxferd``'s ``CANCEL_CONFIRM_S``) for UCX to confirm
#: that nothing more will be written; its answer then carries ``may_still_write``, which the
#: engine needs before it reuses the destination blocks. A shorter margin would end the call
#: first, with a bare deadline error and without that flag.
PULL_ANSWER_MARGIN_S = 10.0
#: Up to this many ids in a plain list are checked in Python; more go through numpy.
_FEW_IDS = 64


def _block_ids(block_ids: Sequence[int] | np.ndarray[Any, Any], what: str) -> list[int]:
    """The ids as a list of ints, checked: 1-D, not empty, each in ``0..MAX_BLOCKS - 1``.

    >>> _block_ids([3, 1], "ids"), _block_ids(np.array([2], dtype=np.int32), "ids")
    ([3, 1], [2])
    """
    # An engine's few ids, as a rule: checked without numpy (a fifth of the cost).
    few = type(block_ids) is list and 0 < len(block_ids) <= _FEW_IDS
    if few and all(type(i) is int for i in block_ids) and min(block_ids) >= 0 and max(block_ids) < MAX_BLOCKS:
        return list(block_ids)  # the caller keeps its own list
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


class AsyncKvxferClient(PoolClient, TierCalls):
    """Asyncio client of the node's kvxferd, over its Unix socket.

    ``socket_path`` defaults to :func:`kvxfer_client.default_socket_path`; ``timeout_s``
    bounds every call except :meth:`pull`, which has its own ``timeout_s``. ``call_stream``
    (default: ``$KVXFER_CALL_STREAM``, on) sends :meth:`offer` and :meth:`pull` on one
    long-lived gRPC stream instead of as unary calls, which halves their gRPC cost; the
    results and errors are the same either way.

    When the daemon restarts, the session ends: calls raise :class:`UnavailableError` until
    :meth:`reconnect`, which opens a new session and registers the client's pools again (same
    memory, same :class:`Pool` objects, same pool ids and offer keys). With ``auto_reconnect``
    the client does that itself as soon as the session is lost, retrying with backoff (50 ms
    doubling to 2 s) until it is back or closed, and a call made meanwhile waits for it up to
    ``timeout_s``; :attr:`connected` says whether a session is up now. Offers and tickets of
    the old daemon died with it: a pull of one raises :class:`NotFoundError`. Losses and
    reconnections are logged to ``logger`` (default: the ``kvxfer_client`` logger).
    """

    def _setup(self) -> None:
        super()._setup()
        self._marks = LayerMarks(self._send_layers_ready)

    async def offer(
        self,
        pool: Pool | PoolRef | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        *,
        lease_s: float = 0.0,
        ticket: Ticket | None = None,
        readers: int | None = None,
        layers: int = 0,
    ) -> Ticket:
        """Pin blocks for a decode engine and return the ticket to hand it.

        ``pool``: this session's pool (or its id), or a :class:`PoolRef` to another session's
        of this engine, e.g. a vLLM worker's pool offered from the scheduler process.
        ``ticket``: one made in advance by :meth:`new_ticket` (and perhaps handed out
        already); the offer is made under its id and token. ``readers``: how many pulls the offer serves
        before it is released (decode ranks that each take their heads; default the ticket's,
        else one). ``layers``: the blocks are still being written, one layer after the other
        (the layout's regions in that many equal groups); say how far with
        :meth:`layers_ready`, and pulls move each layer once written.
        """
        await self._ready()
        pool_id, offer_key = pool_target(pool)
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
        pool: Pool | PoolRef | str,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        transfer_id: str,
        to_peer_address: str,
        *,
        lease_s: float = 0.0,
        layers: int = 0,
    ) -> PushResult:
        """Offer blocks to the decode engine that expects ``transfer_id`` (its :meth:`receive`)
        on the daemon at ``to_peer_address`` (that engine's ``peer_address``): its daemon moves
        them as soon as both sides are there, with no ticket to hand over.

        ``transfer_id``: the router's, unguessable (e.g. 128 random bits), or the receiver
        names this daemon (``from_daemon_id``). Returns once the push is announced; the release
        event (``pulled``, ``failed``, ``expired``) says how it ended. Where the decode daemon
        could not take it, ``mode`` is ``"pull"`` and ``mode_reason`` says why: hand
        ``ticket`` over to be pulled instead. ``pool``, ``layers``: as for :meth:`offer`.
        """
        await self._ready()
        pool_id, offer_key = pool_target(pool)
        offer = engine_pb2.OfferRequest(
            pool_id=pool_id,
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
        await self._marks.say((offer_key, ids), layers)

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

    @property
    def events_dropped(self) -> int:
        """Events dropped, oldest first, because nobody read them (see ``MAX_QUEUED_EVENTS``)."""
        return self._inbox.dropped

    async def next_event(self, timeout_s: float | None = None) -> Event:
        """The next event of this session (released offers, failed transfers)."""
        return await self._inbox.next_event(timeout_s)

    async def events(self) -> AsyncIterator[Event]:
        """Iterate over this session's events until it ends."""
        while (self._reader is not None and not self._reader.done()) or not self._inbox.queue.empty():
            yield await self._inbox.queue.get()

    async def wait_layers(self, transfer_id: str, layers: int, timeout_s: float | None = None) -> int:
        """Wait until the first ``layers`` layers of a layer-wise transfer into this engine's
        pool (its pull or receive, under ``transfer_id``) have landed; returns how many have.
        The pull's own answer still says when the whole transfer has (and whether it failed):
        a layer that landed belongs to a transfer that may yet fail."""
        return await self._inbox.wait_layers(transfer_id, layers, timeout_s, lambda: self._session_lost)

    async def wait_released(self, offer_id: str, timeout_s: float | None = None) -> OfferReleased:
        """Wait until the daemon releases ``offer_id`` and return why."""
        return await self._inbox.wait_released(offer_id, timeout_s, self._session_lost)
