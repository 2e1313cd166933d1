"""What the peer service hands the offering side of a remote transfer: the peer's
``TransferStart`` checked for form (:func:`read_start`, :class:`ServeRequest`) and its end of
the transfer's stream (:class:`OffererStream`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvxfer.errors import InvalidRequestError
from kvxfer.layout import MAX_BLOCKS
from kvxfer.proto import common_pb2, peer_pb2
from kvxfer.ticket import Ticket

from .._config import Settings
from .._offers import OfferTable
from .._steps import MAX_CHUNK, MIN_CHUNK
from ..dataplane.tcp_lanes import MAX_LANES
from ..edge import wire
from .directory import PeerDirectory

__all__ = ["OffererStream", "PeerNode", "ServeRequest", "read_start"]

#: The size of a direct read's nonce (the transports' direct reads use the same).
NONCE_BYTES = 16


@dataclass(frozen=True)
class ServeRequest:
    """A peer's ``TransferStart``, checked for form (:func:`read_start`)."""

    transfer_id: str
    offer_id: str
    token: bytes
    receiver_daemon_id: str
    receiver_signature: common_pb2.LayoutSignature
    num_blocks: int
    tag_base: int
    chunk_bytes: int
    #: The pull's deadline.
    timeout_s: float
    #: The transfer's (peer.proto, ``Transfers``): the pull's plus the puller's peer timeout.
    deadline_s: float
    #: Positions in the offer's block list to send (None: all).
    offer_block_indices: npt.NDArray[np.int64] | None = None
    #: Non-empty when the receiver reads the blocks itself where it can (see :mod:`kvxferd.transports.direct`).
    direct_read_nonce: bytes = b""
    #: The TCP lanes the receiver would open (0: it takes the bytes over UCX).
    tcp_lanes: int = 0


class OffererStream(Protocol):
    """The offering side's end of one transfer on a ``Transfers`` stream, as the control plane
    adapts it."""

    def puller_gone(self) -> bool:
        """The puller gave the transfer up (or the stream is lost)."""

    def on_puller_gone(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the puller gives the transfer up."""

    def time_remaining(self) -> float | None:
        """Seconds left of the transfer's deadline (None: as the start says, from now)."""

    async def send_headers(self) -> None: ...

    async def accepted(self, accepted: peer_pb2.TransferAccepted) -> None:
        """The transfer is accepted: its size and chunks, and how the bytes will come."""

    async def ready(self, layers: int) -> None:
        """Layer-wise direct reads: the first ``layers`` layers are written."""

    async def sent(self, nbytes: int, transport: str, sums: peer_pb2.BlockSums | None = None) -> None: ...

    async def read_done(self) -> tuple[bool, str, int] | None:
        """The puller's ``done`` as ``(ok, detail, readers served)``; None for the end of the
        stream or any other message."""

    async def closed(self) -> None: ...


def read_start(msg: peer_pb2.TransferStart, default_timeout_s: float, peer_timeout_s: float) -> ServeRequest:
    """A peer's ``start``: chunk size, ids and deadlines in range (the offer and token are
    checked when the offer is claimed)."""
    if not MIN_CHUNK <= msg.chunk_bytes <= MAX_CHUNK:
        raise InvalidRequestError(f"chunk_bytes must be in {MIN_CHUNK}..{MAX_CHUNK}")
    wire.transfer_id(msg.transfer_id, required=True)
    if len(msg.offer_id) > 128 or len(msg.receiver_daemon_id) > 256:
        raise InvalidRequestError("offer_id or receiver_daemon_id too long")
    if msg.num_blocks > MAX_BLOCKS:
        raise InvalidRequestError(f"num_blocks must be at most {MAX_BLOCKS}")
    if len(msg.direct_read_nonce) not in (0, NONCE_BYTES):
        raise InvalidRequestError(f"direct_read_nonce must be empty or {NONCE_BYTES} bytes")
    if msg.tcp_lanes > MAX_LANES:
        raise InvalidRequestError(f"tcp_lanes must be at most {MAX_LANES}")
    timeout_s = min(msg.timeout_s or default_timeout_s, wire.MAX_PULL_TIMEOUT_S)
    if not timeout_s > 0:  # also NaN
        raise InvalidRequestError(f"timeout_s must be positive, got {msg.timeout_s}")
    deadline_s = msg.deadline_s or timeout_s + peer_timeout_s
    if not timeout_s <= deadline_s <= 2 * wire.MAX_PULL_TIMEOUT_S:
        raise InvalidRequestError(
            f"deadline_s must be in [timeout_s, {2 * wire.MAX_PULL_TIMEOUT_S:.0f}], got {deadline_s}"
        )
    return ServeRequest(
        transfer_id=msg.transfer_id,
        offer_id=msg.offer_id,
        token=bytes(msg.token),
        receiver_daemon_id=msg.receiver_daemon_id,
        receiver_signature=msg.receiver_signature,
        num_blocks=msg.num_blocks,
        offer_block_indices=wire.offer_block_indices(msg.offer_block_indices),
        tag_base=msg.tag_base,
        chunk_bytes=msg.chunk_bytes,
        timeout_s=timeout_s,
        deadline_s=deadline_s,
        direct_read_nonce=bytes(msg.direct_read_nonce),
        tcp_lanes=msg.tcp_lanes,
    )


class PeerNode(Protocol):
    """What the peer protocol asks of the node (kvxferd's Node): these acts, and no more."""

    settings: Settings
    peers: PeerDirectory
    offers: OfferTable

    def identity(self) -> peer_pb2.PeerIdentity: ...

    def accept_hello(self, identity: peer_pb2.PeerIdentity) -> None: ...

    def write_proof(self, nonce: bytes) -> tuple[int, int]:
        """Write a same-host peer's direct-read nonce where it can read it: (pid, address)."""

    async def serve(self, start: ServeRequest, stream: OffererStream) -> None:
        """Serve a peer's pull of one of our offers on its stream."""

    async def serve_tier_offer(self, request: peer_pb2.PeerTierOfferRequest) -> peer_pb2.PeerTierOfferResponse:
        """Count (and, asked to, offer) the stored prefix of the keys in this node's tier."""

    def push_announced(self, transfer_id: str, ticket: Ticket, lease_s: float, daemon_id: str) -> bool:
        """A peer pushed ``transfer_id``: True when an engine here was waiting for it."""
