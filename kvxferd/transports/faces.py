"""The one face every transport shows a remote transfer: on the decode side a
:class:`Receiver` lands the bytes of one pull (and stops so that nothing more can land when
the pull fails); on the offering side a :class:`Sender` says ``accepted`` and moves them. What
they move is one value each: :class:`Landing` and :class:`Sending`; :class:`Asked` is what a
pull offered the offering daemon to move its bytes by."""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.proto import peer_pb2

from .._folded_sums import FoldedSums
from .._offers import Offer
from .._services import Services
from .._transfers import TransferRecord
from ..dataplane.gpu_kernel import BlockSide
from ..dataplane.plan import SidePlan, num_chunks
from ..memory.pools import Pool
from ..peer.directory import Peer
from ..peer.serve_request import OffererStream, ServeRequest
from ..peer.stream import TransferCall
from .plane import RemotePlane

__all__ = ["Asked", "Landing", "Receiver", "Sender", "Sending"]


@dataclass
class Asked:
    """What this pull offered the offering daemon to move its bytes by (``TransferStart``)."""

    tag_base: int
    nonce: bytes
    lanes: int
    #: The most this side takes per chunk (the offerer picks the size, up to this).
    max_chunk: int


@dataclass
class Landing:
    """What every receiver lands: one pull's record, the peer it pulls from, the destination
    blocks and the plan both sides cut the bytes into."""

    record: TransferRecord
    peer: Peer
    call: TransferCall
    dst: Pool
    dst_ids: np.ndarray[Any, Any]
    plan: SidePlan
    #: Where each layer's chunks start, for an offer written layer by layer (else None).
    starts: list[int] | None


class Receiver(ABC):
    """One way the bytes of one pull land."""

    #: It reads the offering daemon's ``sent`` itself (a layer-wise direct read does, after
    #: the last ``ready``); otherwise the pull reads it beside the landing.
    reads_sent = False

    def __init__(self, landing: Landing, services: Services) -> None:
        self.landing = landing
        self.services = services
        self.task: asyncio.Task[peer_pb2.TransferSent | None] | None = None
        #: The offering daemon's sums, where its ``sent`` came before the landing began.
        self.said_sums: peer_pb2.BlockSums | None = None
        #: Their windows, summed as they landed by a receiver that copies the bytes itself
        #: (None: the pull's check sums the destination).
        self.folded: FoldedSums | None = None

    async def prepare(self, stack: contextlib.AsyncExitStack) -> None:
        """Take what the landing holds until the pull ends (entered on ``stack``); most hold
        nothing."""
        return None

    def start(self) -> asyncio.Task[peer_pb2.TransferSent | None]:
        self.task = asyncio.create_task(self.land())
        return self.task

    @abstractmethod
    async def land(self) -> peer_pb2.TransferSent | None:
        """Land every chunk of the plan; the offerer's ``sent`` where :attr:`reads_sent`."""

    async def stop(self) -> None:
        """The pull failed: stop landing (copy threads stop at their next chunk)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task})


@dataclass
class Sending:
    """One transfer as the offering side moves it: the puller's start, the claimed offer and
    the blocks it sends, the record, the stream, and how the bytes are cut."""

    start: ServeRequest
    peer: Peer
    offer: Offer
    src_ids: npt.NDArray[np.int64]
    record: TransferRecord
    stream: OffererStream
    #: The chunk size this side picked (the puller's maximum, capped by this side's).
    chunk: int = 0
    #: This side's plan where made already (a remapped stream; staging depends on it).
    plan: SidePlan | None = None
    #: The GPU pool's blocks (None for host pools).
    side: BlockSide | None = None
    #: Layers of a layer-wise offer that move or are told per layer (0: whole, once written).
    layers: int = 0
    #: The layers move in batches as they are written (the transfer is large enough).
    per_layer: bool = False
    #: The puller's done came and the offer went as pulled: the outcome is success.
    pulled: bool = False


class Sender(ABC):
    """One way the offering side moves the bytes of one transfer."""

    def __init__(self, sending: Sending, services: Services, plane: RemotePlane) -> None:
        self.sending = sending
        self.services = services
        self.plane = plane

    @abstractmethod
    async def send(self) -> None:
        """Say ``accepted``, then move every byte (or say where the puller reads them)."""

    async def accepted(self, **how: Any) -> None:
        t = self.sending
        signature = t.offer.pool.layout.signature()
        nbytes, chunk = t.record.nbytes, t.chunk
        await t.stream.accepted(
            peer_pb2.TransferAccepted(
                total_bytes=nbytes,
                num_chunks=num_chunks(nbytes, chunk),
                chunk_bytes=chunk,
                sender_signature=signature,
                **how,
            )
        )
        await self.services.faults.hit("after_accepted", transfer_id=t.record.transfer_id)
