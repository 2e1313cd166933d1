"""Peer daemons: Hello once, then keep a channel and the peer's identity; the client side of
the peer protocol (:class:`TransferCall`, lease extension) with its errors as kvxfer errors.

Outgoing peers are dialled by address (from a ticket); incoming ones are known from the Hello
they sent. Either way a peer is keyed by daemon id once its Hello is done.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvxfer_client._config import channel_options
from kvxfer_client._errors import (
    DeadlineExceededError,
    IncompatibleError,
    KvxferError,
    UnavailableError,
    error_from_rpc,
)
from kvxfer_client._proto import common_pb2, peer_pb2, peer_pb2_grpc
from kvxfer_client._version import PROTOCOL_VERSION

from ..dataplane.ucx_address import check_worker_address
from .steps import within

__all__ = ["Peer", "PeerDirectory", "TransferCall"]

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
    #: see :mod:`.direct`).
    direct_read: bool | None = None

    @property
    def daemon_id(self) -> str:
        return self.identity.daemon_id

    @property
    def same_host(self) -> bool:
        return self.identity.hostname == socket.gethostname()

    @property
    def address(self) -> str:
        return self.identity.peer_address

    def open_transfer(self, deadline_s: float) -> TransferCall:
        """Start a ``Transfer`` stream to this peer, ended by gRPC at ``deadline_s``."""
        assert self.stub is not None, "only dialled peers are pulled from"
        return TransferCall(self.stub.Transfer(timeout=deadline_s), self.address)

    async def probe_direct_read(self, nonce: bytes, timeout_s: float) -> peer_pb2.DirectReadProof:
        assert self.stub is not None, "only dialled peers are probed"
        try:
            proof: peer_pb2.DirectReadProof = await self.stub.ProbeDirectRead(
                peer_pb2.DirectReadProbe(nonce=nonce), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            raise peer_error(exc, self.address) from None
        return proof

    async def extend_lease(self, offer_id: str, token: bytes, lease_s: float, timeout_s: float) -> float:
        """Extend an offer of this peer's; returns its seconds left."""
        assert self.stub is not None, "only dialled peers are asked"
        req = peer_pb2.PeerExtendLeaseRequest(offer_id=offer_id, token=token, lease_s=lease_s)
        try:
            resp = await self.stub.ExtendLease(req, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise peer_error(exc, self.address) from None
        return float(resp.lease_remaining_s)


def peer_error(exc: grpc.RpcError, address: str) -> KvxferError:
    """A peer's error status as the kvxfer error it stands for, naming the peer."""
    err = error_from_rpc(exc)
    return type(err)(f"peer {address}: {err}")


class TransferCall:
    """The puller's end of one ``PeerService.Transfer`` stream, step by step (peer.proto).

    Each step raises a kvxfer error: the peer's status (naming the peer), UnavailableError for
    a message out of turn, DeadlineExceededError naming a step that missed its own deadline.
    """

    def __init__(self, call: Any, address: str) -> None:
        self._call = call
        self.address = address

    async def _read(self, expected: str, timeout: float | None) -> Any:
        try:
            msg = await within(self._call.read(), timeout, f"the peer's {expected!r}")
        except grpc.RpcError as exc:
            raise peer_error(exc, self.address) from None
        if msg is grpc.aio.EOF:
            raise UnavailableError(f"peer {self.address} closed the transfer before {expected}")
        if msg.WhichOneof("msg") != expected:
            raise UnavailableError(f"peer {self.address} sent {msg.WhichOneof('msg')} where {expected} was due")
        return getattr(msg, expected)

    async def _write(self, msg: peer_pb2.TransferClientMessage) -> None:
        try:
            await self._call.write(msg)
        except grpc.RpcError as exc:
            raise peer_error(exc, self.address) from None

    async def start(
        self,
        transfer_id: str,
        offer_id: str,
        token: bytes,
        receiver_daemon_id: str,
        receiver_signature: common_pb2.LayoutSignature,
        num_blocks: int,
        offer_block_indices: npt.NDArray[np.int64] | None,
        tag_base: int,
        chunk_bytes: int,
        timeout_s: float,
        direct_read_nonce: bytes = b"",
    ) -> None:
        start = peer_pb2.TransferStart(
            direct_read_nonce=direct_read_nonce,
            offer_block_indices=[] if offer_block_indices is None else offer_block_indices.tolist(),
            transfer_id=transfer_id,
            offer_id=offer_id,
            token=token,
            receiver_daemon_id=receiver_daemon_id,
            receiver_signature=receiver_signature,
            num_blocks=num_blocks,
            tag_base=tag_base,
            chunk_bytes=chunk_bytes,
            timeout_s=timeout_s,
        )
        await self._write(peer_pb2.TransferClientMessage(start=start))

    async def accepted(
        self, timeout: float
    ) -> tuple[int, int, common_pb2.LayoutSignature, peer_pb2.DirectReadSource | None]:
        """The offerer's ``(chunk_bytes, total_bytes, its pool's signature, where its blocks
        lie for a direct read or None)``; 0 chunk bytes: as offered."""
        msg = await self._read("accepted", timeout)
        direct = msg.direct if msg.HasField("direct") else None
        return int(msg.chunk_bytes), int(msg.total_bytes), msg.sender_signature, direct

    async def sent(self) -> None:
        """The offerer has sent every chunk (or ends the stream with its failure)."""
        await self._read("sent", None)

    async def done(self, timeout: float, readers: int = 1) -> None:
        """Say every byte landed (for ``readers`` readers of the offer). From here the offerer
        decides the outcome."""
        done = peer_pb2.TransferDone(ok=True, readers=readers)
        try:
            await self._call.write(peer_pb2.TransferClientMessage(done=done))
        except asyncio.InvalidStateError:
            # The offerer already ended the stream (a cancel or failure on its side): reading
            # it raises its status, which says why.
            await self._read("closed", timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.INTERNAL:
                raise peer_error(exc, self.address) from None
            # gRPC core refused the write as the offerer's status arrived; its reason is lost
            # with it. The pull fails on both sides all the same.
            raise UnavailableError(
                f"peer {self.address} ended the transfer before it read done ({exc.details()})"
            ) from None

    async def closed(self) -> None:
        """The offerer released the offer as pulled: the transfer succeeded."""
        await self._read("closed", None)
        await self._call.done_writing()

    def cancel(self) -> None:
        self._call.cancel()


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


class PeerDirectory:
    def __init__(
        self, identity: peer_pb2.PeerIdentity, timeout_s: float, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        assert identity.protocol_version == PROTOCOL_VERSION
        self.identity = identity
        self._credentials = credentials
        self.timeout_s = timeout_s
        self.by_id: dict[str, Peer] = {}
        self._by_address: dict[str, Peer] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def accept_hello(self, theirs: peer_pb2.PeerIdentity) -> None:
        """Record a peer that said Hello to us."""
        check_compatible(self.identity, theirs)
        peer = self.by_id.get(theirs.daemon_id)
        if peer is None:
            self.by_id[theirs.daemon_id] = Peer(theirs)
        else:
            peer.identity, peer.state, peer.last_hello = theirs, CONNECTED, time.time()

    def known(self, daemon_id: str) -> Peer:
        peer = self.by_id.get(daemon_id)
        if peer is None:
            raise IncompatibleError(f"daemon {daemon_id!r} has not said Hello to this daemon")
        return peer

    async def dial(self, address: str) -> Peer:
        """The peer at ``address``, saying Hello first if we have not (or it failed)."""
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            peer = self._by_address.get(address)
            if peer is not None and peer.state == CONNECTED:
                return peer
            if peer is not None and peer.channel is not None:
                await peer.channel.close()
            channel = (
                grpc.aio.secure_channel(address, self._credentials, options=channel_options())
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
            self._by_address[address] = peer
            self.by_id[peer.daemon_id] = peer
            return peer

    def mark_failed(self, peer: Peer) -> None:
        peer.state = FAILED

    async def close(self) -> None:
        for peer in self._by_address.values():
            if peer.channel is not None:
                await peer.channel.close()
