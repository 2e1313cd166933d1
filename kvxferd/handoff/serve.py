"""The offering side of a remote handoff: answer a peer's pull of one of our offers.

The control plane reads and checks a transfer's ``start`` (:class:`ServeRequest`) and gives
:meth:`TransferServer.serve` the stream as an :class:`OffererStream`; from there this module
claims the offer, sends every chunk over UCX and decides the outcome (peer.proto, "Outcomes"):
the offer is released as pulled only when ``done`` arrives with at least
:data:`~.steps.COMMIT_MARGIN_S` of the transfer's deadline left, and as failed otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvxfer_client._errors import (
    CancelledError,
    DeadlineExceededError,
    IncompatibleError,
    InvalidRequestError,
    KvxferError,
    UnavailableError,
)
from kvxfer_client._layout import mapping_between, signature_mismatch
from kvxfer_client._proto import common_pb2, peer_pb2

from .._config import Settings
from .._faults import Faults
from .._offers import Offer, OfferTable
from .._transfers import TransferRecord, TransferTable
from ..dataplane.gpu_kernel import BlockSide
from ..dataplane.gpucopy import GpuDevices
from ..dataplane.plan import SidePlan, build_layered_plan, build_plan, num_chunks, stream_plan, sub_plan
from ..dataplane.remap import peer_side, plan_remap, side_of
from ..memory.pools import Pool
from .direct import DIRECT_READ, source_of
from .integrity import Integrity
from .lanes import LaneHandoff
from .layers import layer_batches, layer_sizes, send_by_layer
from .peers import Peer
from .remote import RemotePlane
from .steps import COMMIT_MARGIN_S

__all__ = ["OffererStream", "ServeRequest", "TransferServer"]


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
    #: Non-empty when the receiver reads the blocks itself where it can (see :mod:`.direct`).
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

    async def accepted(
        self,
        total_bytes: int,
        num_chunks: int,
        chunk_bytes: int,
        signature: common_pb2.LayoutSignature,
        direct: peer_pb2.DirectReadSource | None = None,
        layers: int = 0,
        lanes: peer_pb2.TcpLanes | None = None,
    ) -> None: ...

    async def ready(self, layers: int) -> None:
        """Layer-wise direct reads: the first ``layers`` layers are written."""

    async def sent(self, nbytes: int, transport: str, sums: peer_pb2.BlockSums | None = None) -> None: ...

    async def read_done(self) -> tuple[bool, str, int] | None:
        """The puller's ``done`` as ``(ok, detail, readers served)``; None for the end of the
        stream or any other message."""

    async def closed(self) -> None: ...


class TransferServer:
    def __init__(
        self,
        settings: Settings,
        plane: RemotePlane,
        offers: OfferTable,
        transfers: TransferTable,
        gpu: Callable[[], GpuDevices],
        faults: Faults,
        integrity: Integrity,
    ) -> None:
        self.settings = settings
        self.plane = plane
        self.ucx = plane.ucx
        self.offers = offers
        self.transfers = transfers
        self._gpu = gpu
        self.faults = faults
        self.integrity = integrity

    async def serve(self, start: ServeRequest, stream: OffererStream) -> None:
        """Serve one pull of one of our offers, from claim to ``closed`` (or a failure)."""
        peer = self.plane.peers.known(start.receiver_daemon_id)
        # Headers go out now, before this transfer can be aborted (``abort`` cancels this
        # task): a cancel landing inside the first write would leave gRPC believing they were
        # never sent, and the abort status that follows (which would resend them) is then
        # rejected, leaving the puller waiting for its deadline.
        await stream.send_headers()
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
        remapped: SidePlan | None = None
        try:
            mismatch = signature_mismatch(offer.pool.layout.signature(), start.receiver_signature)
            if mismatch:
                raise IncompatibleError(f"incompatible layouts: {mismatch}")
            src_ids = offer.blocks_at(start.offer_block_indices)
            record.mapping = mapping_between(offer.pool.layout.signature(), start.receiver_signature)
            if record.mapping and offer.pool.on_gpu:
                raise IncompatibleError(f"GPU pools move blocks as they are; this pull needs {record.mapping}")
            if not record.mapping and start.num_blocks != len(src_ids):
                raise InvalidRequestError(f"the pull moves {len(src_ids)} blocks, its start says {start.num_blocks}")
            record.nbytes = len(src_ids) * offer.pool.layout.bytes_per_block
            if record.mapping:  # checked and sized now: a refusal leaves the offer pullable
                geometry = offer.pool.layout.geometry
                if geometry is None or start.num_blocks > len(src_ids) * geometry.block_tokens:
                    raise InvalidRequestError(f"{start.num_blocks} destination blocks for {len(src_ids)} offered")
                remapped = await asyncio.to_thread(  # off the loop: see LocalHandoff.pull
                    plan_remap,
                    side_of(offer.pool.layout, offer.pool.regions, src_ids),
                    peer_side(start.receiver_signature, start.num_blocks),
                    min(start.chunk_bytes, self.settings.chunk_bytes),
                    "src",
                )
                record.nbytes = remapped.total_bytes
            self.transfers.begin(record)
        except BaseException:
            self.offers.unclaim(offer)
            raise
        # The puller giving up cancels this handler whatever step it is in, so the offer is
        # released at once rather than at our deadline.
        handler = asyncio.current_task()
        serving = True

        def puller_gone() -> None:
            if serving and handler is not None:
                handler.cancel()

        stream.on_puller_gone(puller_gone)
        try:
            with offer.pool.in_use():
                left = stream.time_remaining()
                async with asyncio.timeout(start.deadline_s if left is None else left):
                    await self._send_and_commit(start, peer, offer, src_ids, record, stream, remapped)
        except BaseException as exc:
            # This handler's own deadline (a step's deadline is a DeadlineExceededError already).
            own_deadline = isinstance(exc, TimeoutError) and not isinstance(exc, KvxferError)
            if record.committed:
                # The receiver confirmed every byte and the offer went as pulled; only the
                # closing message was interrupted.
                self.transfers.end(record, common_pb2.TRANSFER_STATE_SUCCEEDED)
            else:
                detail = "deadline exceeded" if own_deadline else str(exc) or repr(exc)
                self.offers.release(offer, common_pb2.RELEASE_REASON_FAILED, detail, record.transfer_id)
                self.transfers.end(record, common_pb2.TRANSFER_STATE_FAILED, detail, exc)
            if own_deadline:
                raise DeadlineExceededError(f"transfer {record.transfer_id} exceeded its deadline") from None
            if isinstance(exc, asyncio.CancelledError) and record.abort_detail:
                # Cancelled here (an engine or operator aborted it), not by the peer giving it
                # up: the puller hears of it (failed), or it would wait for its deadline.
                raise CancelledError(record.abort_detail) from None
            raise
        finally:
            serving = False
        self.transfers.end(record, common_pb2.TRANSFER_STATE_SUCCEEDED)

    async def _send_and_commit(
        self,
        start: ServeRequest,
        peer: Peer,
        offer: Offer,
        src_ids: npt.NDArray[np.int64],
        record: TransferRecord,
        stream: OffererStream,
        remapped: SidePlan | None = None,
    ) -> None:
        """accepted → every chunk → sent → (done) → commit: release as pulled → closed.
        ``remapped``: this side's plan of a remapped stream, made when the pull was checked."""
        pool = offer.pool
        # The receiver's maximum, capped by what this side stages per chunk.
        own = self.settings.gpu_chunk_bytes if pool.on_gpu else self.settings.chunk_bytes
        chunk = min(start.chunk_bytes, own)
        plan: SidePlan | None = None
        side: BlockSide | None = None
        if remapped is not None:
            plan = remapped  # planned at the chunk size this side picks (host pools only)
        elif pool.device is not None:
            side = BlockSide.of(pool.device, pool.base, pool.regions, src_ids)
            plan = stream_plan(side.total_bytes, chunk)
        elif not self.ucx.gather_send or pool.process is not None:
            plan = build_plan(pool.regions, src_ids, chunk)  # staging depends on it
        # A layer-wise offer (still being written) moves per layer where its blocks move as they
        # are, from host memory; otherwise whole, once written.
        layers = offer.layers if remapped is None and side is None else 0
        per_layer = layers > 1 and record.nbytes >= self.settings.layerwise_min_bytes
        asked = start.direct_read_nonce and self.settings.same_host_direct_read and (layers or offer.written)
        lent = source_of(pool, src_ids, start.direct_read_nonce) if asked else None
        if lent is not None:
            source, _nonce_held = lent  # the nonce's memory stays referenced until we return
            # The receiver reads the blocks itself: say where they are (and, layer-wise, how far
            # they are written), and nothing to send.
            record.transport = DIRECT_READ
            signature = pool.layout.signature()
            await stream.accepted(record.nbytes, num_chunks(record.nbytes, chunk), chunk, signature, source, layers)
            await self.faults.hit("after_accepted", transfer_id=record.transfer_id)
            record.mark("lent")
            if layers:
                sizes = layer_sizes([r.block_bytes for r in pool.layout.regions], len(src_ids), layers)
                batch = self.settings.layerwise_batch_bytes if per_layer else float("inf")
                async for _, written in layer_batches(offer, sizes, batch):
                    await stream.ready(written)
        elif start.tcp_lanes and self.plane.lanes is not None and side is None and not per_layer:
            plan = plan or build_plan(pool.regions, src_ids, chunk)
            signature, count = pool.layout.signature(), len(plan.chunks)

            async def announce(lanes: peer_pb2.TcpLanes) -> None:
                await stream.accepted(record.nbytes, count, chunk, signature, None, 0, lanes)

            await LaneHandoff(self.settings, self.plane, self.faults).send(
                start.tcp_lanes, pool, plan, record, announce, offer
            )
        elif per_layer:
            plan, starts = build_layered_plan(pool.regions, src_ids, chunk, layers)
            await self._send(start, peer, pool, src_ids, record, stream, chunk, plan, side, offer, starts)
        else:
            await self._send(start, peer, pool, src_ids, record, stream, chunk, plan, side, offer)
        # The blocks as offered, checked unchanged at the source now that they left.
        sums = await self.integrity.to_send(record, offer, start.offer_block_indices, remapped)
        record.mark("sent")
        await stream.sent(record.nbytes, record.transport, sums)
        done = await stream.read_done()
        record.mark("confirmed")
        await self.faults.hit("after_done_read", transfer_id=record.transfer_id)
        if done is None:
            raise UnavailableError("receiver closed the transfer without confirming")
        ok, detail, readers = done
        if not ok:
            raise UnavailableError(f"receiver reported failure: {detail}")
        left = stream.time_remaining()
        if left is not None and left < COMMIT_MARGIN_S:
            # The puller gives up at this same deadline: closed might not reach it in time, so
            # both sides fail rather than risk a success on this side only.
            raise DeadlineExceededError(
                f"transfer {record.transfer_id}: done came with {max(left, 0.0):.2f}s of the transfer's "
                f"deadline left (under {COMMIT_MARGIN_S}s): too late to commit"
            )
        record.committed = True  # with the release below, in one step of the loop
        self.offers.pulled(offer, record.transfer_id, readers)
        await stream.closed()

    async def _send(
        self,
        start: ServeRequest,
        peer: Peer,
        pool: Pool,
        src_ids: npt.NDArray[np.int64],
        record: TransferRecord,
        stream: OffererStream,
        chunk: int,
        plan: SidePlan | None,
        side: BlockSide | None,
        offer: Offer,
        layer_starts: list[int] | None = None,
    ) -> None:
        """accepted, then every chunk over UCX (``plan``: made already where staging depends on
        it), once written: layer by layer given ``layer_starts`` (where each layer's chunks
        start in ``plan``), else whole."""
        ep = await self.plane.endpoint(peer)
        try:
            await self.faults.hit("endpoint_broken", transfer_id=record.transfer_id, peer=peer.daemon_id)
        except UnavailableError:
            self.ucx.break_endpoint(ep)  # the send below fails, and so would every later one
        staging, need = self.plane.staging_for(pool, plan, "send")
        async with staging.lease(need) as lease:
            record.mark("staging")
            layers = len(layer_starts) - 1 if layer_starts is not None else 0
            signature = pool.layout.signature()
            await stream.accepted(record.nbytes, num_chunks(record.nbytes, chunk), chunk, signature, None, layers)
            await self.faults.hit("after_accepted", transfer_id=record.transfer_id)
            if plan is None:
                # UCX gathers from the pool: planned while the receiver posts receives.
                plan = build_plan(pool.regions, src_ids, chunk)
            record.mark("planned")
            if layer_starts is not None:
                sizes = layer_sizes([r.block_bytes for r in pool.layout.regions], len(src_ids), layers)
                full_plan, starts = plan, layer_starts

                async def send(first: int, end: int) -> None:
                    part = sub_plan(full_plan, starts[first], starts[end])
                    memory, window = pool.host_memory(), self.settings.window
                    fault = self.plane.chunk_fault(record.transfer_id)
                    await self.ucx.send(ep, part, memory, start.tag_base, lease, window, after_chunk=fault)

                # Batches in flight together where none packs into the one staging lease.
                overlap = self.ucx.gather_send and pool.process is None
                await send_by_layer(offer, sizes, self.settings.layerwise_batch_bytes, send, overlap)
                return
            await offer.wait_ready(offer.layers)  # a layer-wise offer moving whole: once written
            if side is not None:
                copier = self._gpu().copier(side.device)
                await self.ucx.send_gpu(
                    ep,
                    plan,
                    copier.upload_side(side),
                    copier,
                    start.tag_base,
                    lease,
                    self.settings.window,
                    mark=record.mark,
                )
            else:
                await self.ucx.send(
                    ep,
                    plan,
                    pool.host_memory(),
                    start.tag_base,
                    lease,
                    self.settings.window,
                    after_chunk=self.plane.chunk_fault(record.transfer_id),
                )
