"""The offering side of a remote handoff: answer a peer's pull of one of our offers.

The control plane reads and checks a transfer's ``start`` (:class:`.serve_request.ServeRequest`)
and gives :meth:`TransferServer.serve` the stream as an ``OffererStream``; from there the steps
are: **claim** the offer (and check the pull against it), **move** the bytes with the sender
:func:`.senders.choose_sender` picks, **verify** the blocks are unchanged at the source, and
**commit** (peer.proto, "Outcomes"): once ``sent`` is on its way the puller decides: its
``done`` releases the offer as pulled, its abort (or the stream's loss) as failed; a cancel on
this side is too late from there.
"""

from __future__ import annotations

import asyncio

import numpy as np
import numpy.typing as npt

from kvxfer.errors import (
    CancelledError,
    DeadlineExceededError,
    IncompatibleError,
    InvalidRequestError,
    KvxferError,
    UnavailableError,
)
from kvxfer.layout import mapping_between, signature_mismatch
from kvxfer.proto import common_pb2

from .._offers import Offer, OfferTable
from .._services import Services
from .._transfers import TransferRecord, TransferTable, described
from ..dataplane.plan import SidePlan
from ..dataplane.remap import peer_side, plan_remap, side_of
from ..peer.directory import Peer
from ..peer.serve_request import OffererStream, ServeRequest
from ..transports.choice import choose_sender
from ..transports.faces import Sending
from ..transports.plane import RemotePlane

__all__ = ["TransferServer"]


class TransferServer:
    def __init__(self, services: Services, plane: RemotePlane, offers: OfferTable, transfers: TransferTable) -> None:
        self.services = services
        self.settings = services.settings
        self.plane = plane
        self.offers = offers
        self.transfers = transfers

    async def serve(self, start: ServeRequest, stream: OffererStream) -> None:
        """Serve one pull of one of our offers, from claim to ``closed`` (or a failure)."""
        peer = self.plane.peers.known(start.receiver_daemon_id)
        # Headers go out now, before this transfer can be aborted (``abort`` cancels this
        # task): a cancel landing inside the first write would leave gRPC believing they were
        # never sent, and the abort status that follows (which would resend them) is then
        # rejected, leaving the puller waiting for its deadline.
        await stream.send_headers()
        sending, remapped = await self._claim(start, peer, stream)
        record = sending.record
        # The puller giving up cancels this handler whatever step it is in, so the offer is
        # released at once rather than at our deadline.
        handler = asyncio.current_task()
        serving = True

        def puller_gone() -> None:
            if serving and handler is not None:
                handler.cancel()

        stream.on_puller_gone(puller_gone)
        try:
            with sending.offer.pool.in_use():
                left = stream.time_remaining()
                async with asyncio.timeout(start.deadline_s if left is None else left):
                    sender = choose_sender(sending, self.services, self.plane, remapped)
                    await sender.send()
                    # The sender lives until the commit: a lent source's nonce stays in our
                    # memory until the puller has read its last byte.
                    await self._commit(sending, remapped)
                    del sender
        except BaseException as exc:
            self._failed(sending, exc)
            if not sending.pulled or isinstance(exc, asyncio.CancelledError):
                raise
            await stream.closed()  # the puller succeeded at done: it hears closed, not this
            return
        finally:
            serving = False
        self.transfers.end(record, common_pb2.TRANSFER_STATE_SUCCEEDED)

    async def _claim(self, start: ServeRequest, peer: Peer, stream: OffererStream) -> tuple[Sending, SidePlan | None]:
        """Claim the offer and check the pull against it (a refusal leaves it pullable); the
        plan of a remapped stream is made here, off the loop."""
        offer = await self.offers.claim_soon(start.offer_id, start.token)
        if stream.puller_gone():
            # The puller gave up (its deadline) before this side claimed: nothing moved, so
            # the offer stays pullable instead of being released as failed.
            self.offers.unclaim(offer)
            raise DeadlineExceededError("the puller left before the offer was claimed")
        record = TransferRecord(
            start.transfer_id,
            "prefill",
            common_pb2.TRANSFER_PATH_REMOTE,
            offer.offer_id,
            peer_daemon_id=peer.daemon_id,
            nbytes=offer.nbytes,
            transport=self.plane.transport(peer, offer.pool),
            pools=(offer.pool.pool_id,),
            mode="push" if offer.pushed_to else "pull",
            mode_reason=offer.pushed_to or "the peer pulled a ticket",
        )
        try:
            src_ids = offer.blocks_at(start.offer_block_indices)
            remapped = await self._check(start, offer, src_ids, record)
            self.transfers.begin(record)
        except BaseException:
            self.offers.unclaim(offer)
            raise
        return Sending(start, peer, offer, src_ids, record, stream), remapped

    async def _check(
        self, start: ServeRequest, offer: Offer, src_ids: npt.NDArray[np.int64], record: TransferRecord
    ) -> SidePlan | None:
        """The pull fits the offer: layouts, block counts; sized, and planned when remapped."""
        mismatch = signature_mismatch(offer.pool.layout.signature(), start.receiver_signature)
        if mismatch:
            raise IncompatibleError(f"incompatible layouts: {mismatch}")
        record.mapping = mapping_between(offer.pool.layout.signature(), start.receiver_signature)
        if record.mapping and offer.pool.on_gpu:
            raise IncompatibleError(f"GPU pools move blocks as they are; this pull needs {record.mapping}")
        if not record.mapping and start.num_blocks != len(src_ids):
            raise InvalidRequestError(f"the pull moves {len(src_ids)} blocks, its start says {start.num_blocks}")
        record.nbytes = len(src_ids) * offer.pool.layout.bytes_per_block
        if not record.mapping:
            return None
        geometry = offer.pool.layout.geometry
        if geometry is None or start.num_blocks > len(src_ids) * geometry.block_tokens:
            raise InvalidRequestError(f"{start.num_blocks} destination blocks for {len(src_ids)} offered")
        remapped = await asyncio.to_thread(  # off the loop: see LocalHandoff.copy_offer
            plan_remap,
            side_of(offer.pool.layout, offer.pool.regions, src_ids),
            peer_side(start.receiver_signature, start.num_blocks),
            min(start.chunk_bytes, self.settings.chunk_bytes),
            "src",
        )
        record.nbytes = remapped.total_bytes
        return remapped

    def _failed(self, sending: Sending, exc: BaseException) -> None:
        """Decide the outcome of a transfer that ended in ``exc``, and say why to the puller
        (raising the error it should hear where that is not ``exc`` itself)."""
        record = sending.record
        # This handler's own deadline (a step's deadline is a DeadlineExceededError already).
        own_deadline = isinstance(exc, TimeoutError) and not isinstance(exc, KvxferError)
        if sending.pulled:
            # The puller said done and the offer went as pulled; only closed was interrupted.
            self.transfers.end(record, common_pb2.TRANSFER_STATE_SUCCEEDED)
            return
        detail = "deadline exceeded" if own_deadline else described(exc)
        self.offers.release(sending.offer, common_pb2.RELEASE_REASON_FAILED, detail, record.transfer_id)
        self.transfers.end(record, common_pb2.TRANSFER_STATE_FAILED, detail, exc)
        if own_deadline:
            raise DeadlineExceededError(f"transfer {record.transfer_id} exceeded its deadline") from None
        if isinstance(exc, asyncio.CancelledError) and record.abort_detail:
            # Cancelled here (an engine or operator aborted it), not by the peer giving it up:
            # the puller hears of it (failed), or it would wait for its deadline.
            raise CancelledError(record.abort_detail) from None

    async def _commit(self, sending: Sending, remapped: SidePlan | None) -> None:
        """Sent, with the sums the blocks are checked against where they land; from there the
        puller decides (its done: release as pulled, then closed)."""
        t, faults = sending, self.services.faults
        record, stream, offer = t.record, t.stream, t.offer
        sums = await self.services.integrity.to_send(record, offer, t.start.offer_block_indices, remapped)
        await faults.hit("before_sent", transfer_id=record.transfer_id)
        record.committed = True  # every byte is out: a cancel here is too late (the puller decides)
        record.mark("sent")
        await stream.sent(record.nbytes, record.transport, sums)
        done = await stream.read_done()
        record.mark("confirmed")
        if done is None:
            raise UnavailableError("receiver closed the transfer without confirming")
        ok, detail, readers = done
        if not ok:  # e.g. its integrity check: did the engine write the blocks again since?
            changed = await self.services.integrity.changed_since_offer(record, offer, t.start.offer_block_indices)
            raise changed or UnavailableError(f"receiver reported failure: {detail}")
        # The puller has reported success to its engine: release as pulled before anything
        # else may happen here, in one step of the loop.
        t.pulled = True
        self.offers.pulled(offer, record.transfer_id, readers)
        await faults.hit("after_done_read", transfer_id=record.transfer_id)
        await stream.closed()
