"""Peer daemons: Hello once, then keep a channel, the peer's identity and the stream our pulls
from it share (:mod:`.stream`); the client side of the other peer calls (lease
extension, direct-read probe) with their errors as kvxfer errors.

Outgoing peers are dialled by address (from a ticket); incoming ones are known from the Hello
they sent. Either way a peer is keyed by daemon id once its Hello is done. Where a fleet
registry runs, a daemon that is not at its ticket's address any more is looked up there by id
(:meth:`PeerDirectory.reach`); the registry is only a hint: the daemon found still proves
itself in Hello, by the id it answers with and, over mTLS, by a certificate naming that id.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from kvxfer.defaults import channel_options
from kvxfer.errors import (
    DeadlineExceededError,
    IncompatibleError,
    KvxferError,
    UnavailableError,
    error_from_rpc,
)
from kvxfer.proto import peer_pb2, peer_pb2_grpc
from kvxfer.version import PROTOCOL_VERSION

from .._log import log_event
from ..dataplane.ucx_address import check_worker_address
from .stream import TransferCall, TransferStream, peer_error

__all__ = ["Peer", "PeerDirectory"]

CONNECTED = "connected"
FAILED = "failed"


@dataclass
class Peer:
    identity: peer_pb2.PeerIdentity
    state: str = CONNECTED
    last_hello: float = field(default_factory=time.time)
    channel: grpc.aio.Channel | None = None
    stub: peer_pb2_grpc.PeerServiceStub | None = None
    #: Whether this daemon may read the peer's memory itself (None: not probed since Hello;
    #: see :mod:`kvxferd.transports.direct_proof`).
    direct_read: bool | None = None
    #: The ``Transfers`` stream our pulls from this peer share (dialled peers only).
    transfers: TransferStream | None = None
    #: The transport bytes to this peer take, by whether this side's pool is GPU memory
    #: (named once per peer: see ``RemotePlane.transport``).
    transports: dict[bool, str] = field(default_factory=dict)

    @property
    def daemon_id(self) -> str:
        return self.identity.daemon_id

    @functools.cached_property
    def same_host(self) -> bool:
        return self.identity.hostname == socket.gethostname()

    @property
    def address(self) -> str:
        return self.identity.peer_address

    def open_transfer(self, transfer_id: str) -> TransferCall:
        """A new transfer on this daemon's stream to the peer (opened first if none works)."""
        assert self.stub is not None, "only dialled peers are pulled from"
        if self.transfers is None or self.transfers.broken is not None:
            self.transfers = TransferStream(self.stub, self.address)
        return self.transfers.open(transfer_id)

    async def close(self) -> None:
        if self.transfers is not None:
            await self.transfers.close()
        if self.channel is not None:
            await self.channel.close()

    async def probe_direct_read(self, nonce: bytes, timeout_s: float) -> peer_pb2.DirectReadProof:
        assert self.stub is not None, "only dialled peers are probed"
        try:
            proof: peer_pb2.DirectReadProof = await self.stub.ProbeDirectRead(
                peer_pb2.DirectReadProbe(nonce=nonce), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            raise peer_error(exc, self.address) from None
        return proof

    async def announce(self, request: peer_pb2.PushAnnouncement, timeout_s: float) -> bool:
        """Announce a pushed offer (see :mod:`.push`); True when the peer's engine was waiting."""
        assert self.stub is not None, "only dialled peers are pushed to"
        try:
            answer: peer_pb2.PushAnnounced = await self.stub.Announce(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise peer_error(exc, self.address) from None
        return bool(answer.matched)

    async def tier_offer(
        self, request: peer_pb2.PeerTierOfferRequest, timeout_s: float
    ) -> peer_pb2.PeerTierOfferResponse:
        """Ask the peer's KV tier for the stored prefix of keys (and its offer)."""
        assert self.stub is not None, "only dialled peers are asked"
        try:
            resp: peer_pb2.PeerTierOfferResponse = await self.stub.TierOffer(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise peer_error(exc, self.address) from None
        return resp

    async def extend_lease(self, offer_id: str, token: bytes, lease_s: float, timeout_s: float) -> float:
        """Extend an offer of this peer's; returns its seconds left."""
        assert self.stub is not None, "only dialled peers are asked"
        req = peer_pb2.PeerExtendLeaseRequest(offer_id=offer_id, token=token, lease_s=lease_s)
        try:
            resp = await self.stub.ExtendLease(req, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise peer_error(exc, self.address) from None
        return float(resp.lease_remaining_s)


def check_compatible(ours: peer_pb2.PeerIdentity, theirs: peer_pb2.PeerIdentity) -> None:
    if theirs.protocol_version != ours.protocol_version:
        raise IncompatibleError(
            f"peer {theirs.daemon_id!r} speaks protocol {theirs.protocol_version}, "
            f"this daemon speaks {ours.protocol_version} (versions {theirs.version} vs {ours.version})"
        )
    if not theirs.daemon_id or len(theirs.daemon_id) > 256 or theirs.daemon_id == ours.daemon_id:
        raise IncompatibleError(f"peer daemon id {theirs.daemon_id!r} is empty, too long or equals ours")
    if not theirs.ucx_worker_address:
        raise IncompatibleError(f"peer {theirs.daemon_id!r} has no UCX worker (data plane unavailable there)")
    check_worker_address(theirs.ucx_worker_address, repr(theirs.daemon_id))


class AddressBook(Protocol):
    """Where daemons are, by id (the fleet registry)."""

    def address_of(self, daemon_id: str) -> str | None: ...

    def left_why(self, daemon_id: str) -> str: ...


class PeerDirectory:
    def __init__(
        self,
        identity: peer_pb2.PeerIdentity,
        timeout_s: float,
        credentials: grpc.ChannelCredentials | None = None,
        book: AddressBook | None = None,
    ) -> None:
        assert identity.protocol_version == PROTOCOL_VERSION
        self.identity = identity
        self._credentials = credentials
        self.book = book
        self.timeout_s = timeout_s
        self.by_id: dict[str, Peer] = {}
        self._by_address: dict[str, Peer] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: Called with a daemon id that came back with another UCX worker (it restarted),
        #: whichever way this daemon learnt it (its Hello, or ours to it): its endpoint goes.
        self.on_new_worker: Callable[[str], None] | None = None

    def accept_hello(self, theirs: peer_pb2.PeerIdentity) -> None:
        """Record a peer that said Hello to us."""
        check_compatible(self.identity, theirs)
        peer = self.by_id.get(theirs.daemon_id)
        if peer is None:
            self.by_id[theirs.daemon_id] = Peer(theirs)
        else:
            self._check_worker(peer, theirs)
            peer.identity, peer.state, peer.last_hello = theirs, CONNECTED, time.time()

    def _check_worker(self, known: Peer, theirs: peer_pb2.PeerIdentity) -> None:
        if known.identity.ucx_worker_address != theirs.ucx_worker_address and self.on_new_worker is not None:
            self.on_new_worker(theirs.daemon_id)

    def known(self, daemon_id: str) -> Peer:
        peer = self.by_id.get(daemon_id)
        if peer is None:
            raise IncompatibleError(f"daemon {daemon_id!r} has not said Hello to this daemon")
        return peer

    async def reach(self, daemon_id: str, address: str) -> Peer:
        """The daemon ``daemon_id``: where the registry has it, when that is not ``address``
        (a ticket's: the daemon restarted elsewhere since) and it proves to be that daemon
        there; else at ``address``. The caller checks the id of the peer returned (the daemon
        at a ticket's address may be another one by now)."""
        why = self.book.left_why(daemon_id) if self.book is not None else ""
        if why:
            raise UnavailableError(f"daemon {daemon_id!r} left the fleet registry ({why}); its offers went with it")
        found = self.book.address_of(daemon_id) if self.book is not None else None
        if found is not None and found != address:
            try:
                peer = await self.dial(found, daemon_id)
            except KvxferError as exc:
                log_event("peer.registry_refused", logging.WARNING, peer=daemon_id, address=found, detail=str(exc))
            else:
                if peer.daemon_id == daemon_id:
                    log_event("peer.found_in_registry", peer=daemon_id, ticket_address=address, address=found)
                    return peer
                log_event(
                    "peer.registry_refused",
                    logging.WARNING,
                    peer=daemon_id,
                    address=found,
                    detail=f"the daemon there said Hello as {peer.daemon_id!r}",
                )
        return await self.dial(address, daemon_id)

    async def dial(self, address: str, expect_id: str = "") -> Peer:
        """The peer at ``address``, saying Hello first if we have not (or it failed). Over
        mTLS, ``expect_id`` must be named by the certificate the peer presents."""
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            peer = self._by_address.get(address)
            if peer is not None and peer.state == CONNECTED:
                return peer
            if peer is not None:
                await peer.close()
            options: list[tuple[str, Any]] = list(channel_options())
            if expect_id and self._credentials is not None:
                options = [*options, ("grpc.ssl_target_name_override", expect_id)]
            channel = (
                grpc.aio.secure_channel(address, self._credentials, options=options)
                if self._credentials is not None
                else grpc.aio.insecure_channel(address, options=channel_options())
            )
            stub = peer_pb2_grpc.PeerServiceStub(channel)
            try:
                resp = await stub.Hello(
                    peer_pb2.HelloRequest(identity=self.identity), timeout=self.timeout_s, wait_for_ready=False
                )
            except grpc.RpcError as exc:
                await channel.close()
                err = error_from_rpc(exc)
                if isinstance(err, DeadlineExceededError):
                    raise UnavailableError(f"peer {address} did not answer Hello within {self.timeout_s}s") from None
                raise type(err)(f"Hello to peer {address} failed: {err}") from None
            check_compatible(self.identity, resp.identity)
            peer = Peer(resp.identity, channel=channel, stub=stub)
            known = self.by_id.get(peer.daemon_id)
            if known is not None:
                self._check_worker(known, resp.identity)
            self._by_address[address] = peer
            self.by_id[peer.daemon_id] = peer
            return peer

    def mark_failed(self, peer: Peer) -> None:
        peer.state = FAILED

    def forget(self, daemon_id: str, why: UnavailableError) -> Peer | None:
        """The daemon is gone: every pull on its stream fails with ``why``, and the next
        transfer says Hello again. Returns the peer (None if we never knew it)."""
        peer = self.by_id.get(daemon_id)
        if peer is not None:
            if peer.transfers is not None:
                peer.transfers.fail(why)
            peer.state = FAILED
        return peer

    async def close(self) -> None:
        for peer in self._by_address.values():
            await peer.close()
