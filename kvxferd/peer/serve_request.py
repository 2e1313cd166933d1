"""What the control plane hands the offering side of a remote transfer: the peer's checked
``TransferStart`` (:class:`ServeRequest`) and its end of the transfer's stream
(:class:`OffererStream`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvxfer.proto import common_pb2, peer_pb2

__all__ = ["OffererStream", "ServeRequest"]


@dataclass(frozen=True)
class ServeRequest:
    """A peer's ``TransferStart``, checked for form by the control plane."""

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
