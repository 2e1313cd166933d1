"""The decode side of a remote handoff: pull an offer from the daemon that made it.

One pull is a few named steps, each a method below: **dial** the offering daemon (Hello once
per peer), **ask** (``TransferStart`` on our ``PeerService.Transfers`` stream to it,
:mod:`kvxferd.peer.stream`, saying how this side can take the bytes), **negotiate** (its
``accepted``: chunk size, byte count, layers; the plan of the destination's chunks), **move**
(the receiver :func:`.receivers.choose_receiver` picks lands every chunk while the offerer's
``sent`` is awaited beside it), **verify** (the landed blocks against the sums ``sent``
carried) and **commit** (``done``: the pull has succeeded; the offerer's ``closed`` is read
off the engine's path). A failure at any step stops the receiver (nothing may land after
the engine hears of it) and aborts the transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from kvxfer.errors import DataLossError, DeadlineExceededError, IncompatibleError, KvxferError, UnavailableError
from kvxfer.layout import mapping_between
from kvxfer.proto import peer_pb2

from .._folded_sums import FoldedSums
from .._log import log_event
from .._services import Services
from .._steps import MIN_CHUNK, within
from ..dataplane.gpu_kernel import BlockSide
from ..dataplane.plan import SMALL_PLAN, SidePlan, build_layered_plan, build_plan, stream_plan
from ..dataplane.remap import peer_side, plan_remap, side_of
from ..memory.pools import Pool
from ..peer.directory import Peer
from ..peer.stream import TransferCall
from ..transports.choice import choose_receiver, sums_of
from ..transports.direct import reads_alike
from ..transports.direct_proof import new_nonce
from ..transports.faces import Asked, Landing, Receiver
from ..transports.lanes import lanes_to_ask
from ..transports.plane import RemotePlane
from .order import PullOrder

__all__ = ["OFFERER_WORD_S", "RemotePull"]

#: How long a failed read waits for the offerer's word on the transfer (its failure, if any).
OFFERER_WORD_S = 1.0

HandOn = Callable[[], Awaitable[int]]


class RemotePull:
    def __init__(self, daemon_id: str, services: Services, plane: RemotePlane) -> None:
        self.daemon_id = daemon_id
        self.services = services
        self.settings = services.settings
        self.plane = plane
        #: Reads of the offerers' closed after done (off the engines' path), held till they end.
        self._closing: set[asyncio.Task[None]] = set()

    async def fetch(self, order: PullOrder, hand_on: HandOn | None = None) -> None:
        """Pull the ticket's offer (the blocks at ``order.indices`` of its list, or all) into
        the destination blocks. The order's deadline stops applying once ``done`` is on its
        way (the offerer decides from there). ``hand_on``, awaited once every byte has landed
        and before done, copies them on to other readers (:mod:`.shared`) and says how many
        it served."""
        record = order.record
        peer = await self._dial(order)
        async with contextlib.AsyncExitStack() as stack:
            endpoint = await self.plane.endpoint(peer)
            record.mark("endpoint")
            # The transfer's deadline (the offerer keeps it too) bounds the wait for closed.
            ends_at = asyncio.get_running_loop().time() + order.timeout_s + self.settings.peer_timeout_s
            call = peer.open_transfer(record.transfer_id)
            record.mark("opened")
            receiver: Receiver | None = None
            try:
                asked = await self._ask(order, peer, call)
                accepted, plan, starts = await self._negotiate(order, call, asked)
                landing = Landing(record, peer, call, order.dst, order.dst_ids, plan, starts)
                receiver = choose_receiver(landing, self.services, self.plane, accepted, asked, endpoint)
                await receiver.prepare(stack)
                said = await self._move(receiver, call, ends_at)
                await self._check(order, call, sums_of(said), plan if record.mapping else None, receiver.folded)
                await self._commit(order, call, hand_on, ends_at)
            except BaseException as exc:
                await self._fail(order, peer, call, receiver, exc)
                raise

    async def _dial(self, order: PullOrder) -> Peer:
        """The offering daemon, proved to be the one the ticket names."""
        ticket = order.ticket
        peer = await self.plane.dial_offerer(ticket)
        if peer.daemon_id != ticket.daemon_id:
            raise IncompatibleError(
                f"the daemon at {ticket.peer_address} is {peer.daemon_id!r}, the ticket names {ticket.daemon_id!r}"
            )
        order.record.transport = self.plane.transport(peer, order.dst)
        order.record.mark("dialled")
        return peer

    async def _ask(self, order: PullOrder, peer: Peer, call: TransferCall) -> Asked:
        """Send ``TransferStart``: the offer and its token, the destination's signature, and
        every way this side can take the bytes (its chunk size, tags, a direct-read nonce, TCP
        lanes)."""
        record, dst, s = order.record, order.dst, self.settings
        # The most this side can take per chunk; the sender picks the size (TransferAccepted).
        max_chunk = s.gpu_chunk_bytes if dst.on_gpu else s.chunk_bytes
        nonce = new_nonce() if dst.device is None and await self.plane.direct_read_ok(peer) else b""
        asked = Asked(secrets.randbits(40) << 24, nonce, lanes_to_ask(s, record.transport, dst, bool(nonce)), max_chunk)
        call.start(
            peer_pb2.TransferStart(
                transfer_id=record.transfer_id,
                offer_id=order.ticket.offer_id,
                token=order.ticket.token,
                receiver_daemon_id=self.daemon_id,
                receiver_signature=dst.layout.signature(),
                num_blocks=len(order.dst_ids),
                offer_block_indices=[] if order.indices is None else order.indices.tolist(),
                tag_base=asked.tag_base,
                chunk_bytes=max_chunk,
                timeout_s=order.timeout_s,
                direct_read_nonce=nonce,
                deadline_s=order.timeout_s + s.peer_timeout_s,
                tcp_lanes=asked.lanes,
            )
        )
        record.mark("start_sent")
        return asked

    async def _negotiate(
        self, order: PullOrder, call: TransferCall, asked: Asked
    ) -> tuple[peer_pb2.TransferAccepted, SidePlan, list[int] | None]:
        """The offerer's ``accepted``, checked, and the destination's plan in its chunks (and
        where each layer's chunks start, for an offer written layer by layer)."""
        record, dst = order.record, order.dst
        side = _gpu_side(order)
        # Planned while the offerer claims and plans its side (the sender nearly always takes
        # the offered chunk size), once the stream's writer has sent ``start``: it runs only
        # when this task yields, and planning first kept ``start`` back 0.2 ms.
        await asyncio.sleep(0)
        mapped = dst.layout.geometry is not None
        # A pull between two geometries may be remapped, and a direct read of blocks laid
        # out alike needs no plan (it reads segment to segment): planned here only when
        # small, so that a plan not used wastes little.
        small = len(order.dst_ids) * len(dst.regions.nbytes) <= SMALL_PLAN
        alike = bool(asked.nonce) and not mapped and reads_alike(dst)
        ahead = small or not (mapped or alike)
        expected = _receive_plan(dst, side, order.dst_ids, asked.max_chunk) if ahead else None
        accepted = await call.accepted(self.settings.peer_timeout_s)
        record.mark("accepted")
        chunk = accepted.chunk_bytes or asked.max_chunk
        if not MIN_CHUNK <= chunk <= asked.max_chunk:
            raise IncompatibleError(f"peer chose {chunk}-byte chunks; this side takes {MIN_CHUNK}..{asked.max_chunk}")
        record.mapping = mapping_between(accepted.sender_signature, dst.layout.signature()) if mapped else ""
        layers, starts = accepted.layers, None
        if layers and (record.mapping or side is not None or layers > len(dst.regions.nbytes)):
            raise IncompatibleError(f"peer cut the stream into {layers} layers, which this pull cannot take")
        if layers:
            # Written layer by layer: both sides cut the stream per layer (peer.proto).
            plan, starts = build_layered_plan(dst.regions, order.dst_ids, chunk, layers)
        elif record.mapping:
            plan = await self._remapped_plan(order, accepted.sender_signature, chunk, side)
        elif expected is not None and chunk == asked.max_chunk:
            plan = expected
        elif alike and accepted.HasField("direct"):
            plan = stream_plan(record.nbytes, chunk)  # its chunks only: DirectRead reads the rows
        else:
            plan = _receive_plan(dst, side, order.dst_ids, chunk)
        if accepted.total_bytes != plan.total_bytes:
            raise IncompatibleError(f"peer sends {accepted.total_bytes} bytes, destination expects {plan.total_bytes}")
        return accepted, plan, starts

    async def _remapped_plan(self, order: PullOrder, sender: Any, chunk: int, side: BlockSide | None) -> SidePlan:
        """The plan of a stream between two geometries (other TP, head order, block size)."""
        if side is not None:
            raise IncompatibleError(f"GPU pools move blocks as they are; this pull needs {order.record.mapping}")
        sender_blocks = len(order.indices) if order.indices is not None else order.ticket.num_blocks
        src_side = peer_side(sender, sender_blocks)
        dst_side = side_of(order.dst.layout, order.dst.regions, order.dst_ids)
        plan = await asyncio.to_thread(plan_remap, src_side, dst_side, chunk, "dst")  # off the loop
        order.record.nbytes = plan.total_bytes
        return plan

    async def _move(self, receiver: Receiver, call: TransferCall, ends_at: float) -> Any:
        """Land every byte, with the offerer's ``sent`` (or failure) awaited beside it; returns
        what the offerer said once they landed (its ``sent``, with the block sums)."""
        record = receiver.landing.record
        started = time.perf_counter()
        if not receiver.reads_sent and call.word_waiting():
            # The offerer's word came with its accepted (a lent source is "sent" at once): read
            # it (here already: no deadline to wait on), then land here, without a task for each
            # (two turns of the loop).
            said = await call.sent()
            receiver.said_sums = sums_of(said)  # a receiver that copies may sum as it lands
            await receiver.land()
            record.data_plane_s = time.perf_counter() - started
            record.mark("received")
            return said
        receiving = receiver.start()
        sent: asyncio.Task[peer_pb2.TransferSent] | None = None
        try:
            if not receiver.reads_sent:
                sent = asyncio.create_task(call.sent())
                first, _ = await asyncio.wait({receiving, sent}, return_when=asyncio.FIRST_COMPLETED)
                if receiving in first and receiving.exception() is not None and not sent.done():
                    # A direct read that failed may have seen the offerer's own failure first
                    # (it ended the transfer and let go of the nonce): its word, due within a
                    # moment, says why.
                    await asyncio.wait({sent}, timeout=OFFERER_WORD_S)
                if sent.done() and (sent in first or sent.exception() is not None):
                    sent.result()  # the offerer failed (or aborted) while bytes were due: end now
            landed = await receiving
            record.data_plane_s = time.perf_counter() - started
            record.mark("received")
            # Every chunk has landed (the tags are this transfer's own); the offerer's "sent"
            # carries the sums they are checked against, before any reader hears of them.
            return landed if sent is None else await within(sent, _left(ends_at), "the peer's 'sent'")
        except BaseException:
            if sent is not None and not sent.done():
                sent.cancel()
            raise

    async def _check(
        self,
        order: PullOrder,
        call: TransferCall,
        sums: peer_pb2.BlockSums | None,
        mapped: SidePlan | None,
        folded: FoldedSums | None = None,
    ) -> None:
        """The landed blocks against the offerer's sums. A mismatch is told to the offerer
        (``done`` not ok), whose word, due within a moment, says whether its engine wrote
        the blocks again since the offer (then that error is the pull's)."""
        try:
            await self.services.integrity.check_landed(order.record, sums, order.dst, order.dst_ids, mapped, folded)
        except DataLossError as landed:
            call.reject(str(landed))
            try:
                await call.closed(OFFERER_WORD_S)
            except DataLossError as found:
                raise found from None
            except KvxferError:
                pass
            raise
        order.record.mark("checked")

    async def _commit(self, order: PullOrder, call: TransferCall, hand_on: HandOn | None, ends_at: float) -> None:
        """Hand the bytes on to other readers and say ``done``: every byte landed and was
        checked, so the pull has succeeded (peer.proto, "Outcomes"); the offerer's ``closed``
        is read off the engine's path."""
        record, faults = order.record, self.services.faults
        readers = 1 + (await hand_on() if hand_on is not None else 0)
        await faults.hit("before_done", transfer_id=record.transfer_id)
        # The pull's own deadline still holds here, and ends peer_timeout_s before the
        # transfer's (which the offerer keeps, from later still): it has that long to read done.
        record.committed = True  # the offerer releases the offer as pulled on this message
        call.done(readers)
        record.mark("done")
        if order.deadline is not None:
            order.deadline.reschedule(None)  # nothing left to time out on the engine's path
        # Its reader starts once the engine's answer is on its way (started in this turn).
        asyncio.get_running_loop().call_soon(self._start_closing, call, record.transfer_id, ends_at)

    def _start_closing(self, call: TransferCall, transfer_id: str, ends_at: float) -> None:
        closing = asyncio.create_task(self._read_closed(call, transfer_id, ends_at))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def _read_closed(self, call: TransferCall, transfer_id: str, ends_at: float) -> None:
        """The offerer's word after done: closed as a rule; anything else is logged (the
        puller's engine already has its bytes)."""
        try:
            await self.services.faults.hit("before_closed_read", transfer_id=transfer_id)
            await call.closed(_left(ends_at))
        except KvxferError as exc:
            log_event("transfer.close_failed", logging.WARNING, transfer_id=transfer_id, detail=str(exc))
            call.abort(str(exc))

    async def _fail(
        self, order: PullOrder, peer: Peer, call: TransferCall, receiver: Receiver | None, exc: BaseException
    ) -> None:
        """Stop the landing, abort the transfer, and say why in the error the engine gets."""
        if receiver is not None:
            await receiver.stop()
        call.abort(_why(exc))
        if isinstance(exc, UnavailableError):
            self.plane.drop_peer(peer)  # the next pull says Hello again and makes a new endpoint


def _left(ends_at: float) -> float:
    """Seconds until the loop time ``ends_at`` (at least a moment: the step then times out)."""
    return max(ends_at - asyncio.get_running_loop().time(), 1e-3)


def _why(exc: BaseException) -> str:
    """The reason an abort gives the offerer."""
    if isinstance(exc, asyncio.CancelledError):
        return "the pull was cancelled"
    if isinstance(exc, TimeoutError) and not isinstance(exc, DeadlineExceededError):
        return "the pull's deadline passed"
    return str(exc) or type(exc).__name__


def _gpu_side(order: PullOrder) -> BlockSide | None:
    dst = order.dst
    return BlockSide.of(dst.device, dst.base, dst.regions, order.dst_ids) if dst.device is not None else None


def _receive_plan(dst: Pool, side: BlockSide | None, dst_ids: np.ndarray[Any, Any], chunk: int) -> SidePlan:
    """The destination's chunks: computed on the GPU for GPU pools, planned runs for host."""
    if side is not None:
        return stream_plan(side.total_bytes, chunk)
    return build_plan(dst.regions, dst_ids, chunk)
