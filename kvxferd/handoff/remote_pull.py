"""The decode side of a remote handoff: pull an offer from the daemon that made it, one
transfer on our ``PeerService.Transfers`` stream to it for the steps (:mod:`.transfer_stream`)
and UCX tagged messages (or a direct read, :mod:`.direct`) for the bytes.

Steps (peer.proto): start → accepted → (chunks land) → done → closed. Every chunk is a
receive posted ahead (``window`` at once) with tag ``tag_base | chunk``, straight into the
pool where UCX can scatter it, else into staging and then unpacked (host) or scattered by
one kernel per chunk (GPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np

from kvxfer_client._errors import DeadlineExceededError, IncompatibleError, UnavailableError
from kvxfer_client._layout import mapping_between
from kvxfer_client._proto import common_pb2, peer_pb2
from kvxfer_client._ticket import Ticket

from .._config import Settings
from .._faults import Faults
from .._transfers import TransferRecord
from ..dataplane.gpu_kernel import BlockSide
from ..dataplane.gpucopy import GpuDevices
from ..dataplane.plan import SidePlan, build_layered_plan, build_plan, stream_plan, sub_plan
from ..dataplane.remap import peer_side, plan_remap, side_of
from ..dataplane.staging import StagingLease
from ..dataplane.ucp_iov import CANCEL_CONFIRM_S
from ..memory.pools import Pool
from .direct import DIRECT_READ, new_nonce, nonce_missing, source_plan
from .integrity import Integrity
from .lanes import LaneHandoff, lanes_to_ask
from .layers import LayerProgress
from .local import copy_in_threads
from .peers import Peer
from .remote import RemotePlane
from .steps import MIN_CHUNK, within
from .transfer_stream import TransferCall

__all__ = ["OFFERER_WORD_S", "RemotePull"]

#: How long a failed read waits for the offerer's word on the transfer (its failure, if any).
OFFERER_WORD_S = 1.0


class RemotePull:
    def __init__(
        self,
        daemon_id: str,
        settings: Settings,
        plane: RemotePlane,
        executor: Executor,
        gpu: Callable[[], GpuDevices],
        faults: Faults,
        integrity: Integrity,
    ) -> None:
        self.daemon_id = daemon_id
        self.settings = settings
        self.plane = plane
        self.ucx = plane.ucx
        self.executor = executor
        self._gpu = gpu
        self.faults = faults
        self.integrity = integrity

    async def pull(
        self,
        record: TransferRecord,
        ticket: Ticket,
        dst: Pool,
        dst_ids: np.ndarray[Any, Any],
        indices: np.ndarray[Any, Any] | None,
        timeout: float,
        deadline: asyncio.Timeout,
        hand_on: Callable[[], Awaitable[int]] | None = None,
    ) -> None:
        """Pull the ticket's offer (the blocks at ``indices`` of its list, or all) into
        ``dst_ids`` of ``dst``. ``deadline`` is the pull's own;
        it stops applying once ``done`` is on its way (the offerer decides from there).
        ``hand_on``, awaited once every byte has landed and before done, copies them on to
        other readers (:mod:`.shared`) and says how many it served."""
        peer = await self.plane.dial_offerer(ticket)
        if peer.daemon_id != ticket.daemon_id:
            raise IncompatibleError(
                f"the daemon at {ticket.peer_address} is {peer.daemon_id!r}, the ticket names {ticket.daemon_id!r}"
            )
        record.transport = self.plane.transport(peer, dst)
        record.mark("dialled")
        # The most this side can take per chunk; the sender picks the size (TransferAccepted).
        max_chunk = self.settings.gpu_chunk_bytes if dst.on_gpu else self.settings.chunk_bytes
        side = BlockSide.of(dst.device, dst.base, dst.regions, dst_ids) if dst.device is not None else None
        async with contextlib.AsyncExitStack() as stack:
            ep = await self.plane.endpoint(peer)
            record.mark("endpoint")
            tag_base = secrets.randbits(40) << 24
            # The transfer's deadline (the offerer keeps it too) bounds the wait for closed.
            transfer_deadline_s = timeout + self.settings.peer_timeout_s
            ends_at = asyncio.get_running_loop().time() + transfer_deadline_s
            call = peer.open_transfer(record.transfer_id)
            record.mark("opened")
            receiving: asyncio.Task[Any] | None = None
            sent: asyncio.Task[Any] | None = None
            lease: StagingLease | None = None
            nonce = new_nonce() if side is None and await self.plane.direct_read_ok(peer) else b""
            asked_lanes = lanes_to_ask(self.settings, record.transport, dst, bool(nonce))
            source = by_lanes = None
            try:
                call.start(
                    peer_pb2.TransferStart(
                        transfer_id=record.transfer_id,
                        offer_id=ticket.offer_id,
                        token=ticket.token,
                        receiver_daemon_id=self.daemon_id,
                        receiver_signature=dst.layout.signature(),
                        num_blocks=len(dst_ids),
                        offer_block_indices=[] if indices is None else indices.tolist(),
                        tag_base=tag_base,
                        chunk_bytes=max_chunk,
                        timeout_s=timeout,
                        direct_read_nonce=nonce,
                        deadline_s=transfer_deadline_s,
                        tcp_lanes=asked_lanes,
                    )
                )
                record.mark("start_sent")
                # Planned while the offerer claims and plans its side (the sender nearly
                # always takes the offered chunk size).
                mapped = dst.layout.geometry is not None
                expected = None if mapped else _receive_plan(dst, side, dst_ids, max_chunk)
                accepted = await call.accepted(self.settings.peer_timeout_s)
                record.mark("accepted")
                chunk, total_bytes = accepted.chunk_bytes or max_chunk, accepted.total_bytes
                sender = accepted.sender_signature
                source = accepted.direct if accepted.HasField("direct") else None
                by_lanes = accepted.lanes if accepted.HasField("lanes") else None
                if by_lanes is not None and (not asked_lanes or accepted.layers or source is not None):
                    raise IncompatibleError(f"peer {peer.daemon_id} answered with TCP lanes this pull cannot take")
                if not MIN_CHUNK <= chunk <= max_chunk:
                    raise IncompatibleError(f"peer chose {chunk}-byte chunks; this side takes {MIN_CHUNK}..{max_chunk}")
                record.mapping = mapping_between(sender, dst.layout.signature()) if mapped else ""
                layers, starts = accepted.layers, None
                if layers and (record.mapping or side is not None or layers > len(dst.regions.nbytes)):
                    raise IncompatibleError(f"peer cut the stream into {layers} layers, which this pull cannot take")
                if layers:
                    # Written layer by layer: both sides cut the stream per layer (peer.proto).
                    plan, starts = build_layered_plan(dst.regions, dst_ids, chunk, layers)
                elif record.mapping:
                    if side is not None:
                        raise IncompatibleError(f"GPU pools move blocks as they are; this pull needs {record.mapping}")
                    sender_blocks = len(indices) if indices is not None else ticket.num_blocks
                    src_side = peer_side(sender, sender_blocks)
                    dst_side = side_of(dst.layout, dst.regions, dst_ids)
                    plan = await asyncio.to_thread(plan_remap, src_side, dst_side, chunk, "dst")  # off the loop
                    record.nbytes = plan.total_bytes
                elif expected is not None and chunk == max_chunk:
                    plan = expected
                else:
                    plan = _receive_plan(dst, side, dst_ids, chunk)
                if total_bytes != plan.total_bytes:
                    raise IncompatibleError(f"peer sends {total_bytes} bytes, destination expects {plan.total_bytes}")
                if source is not None:
                    started = time.perf_counter()
                    layered = (call, starts) if starts is not None else None
                    receiving = asyncio.create_task(
                        self._read(record, peer, source, sender, dst, dst_ids, plan, nonce, layered)
                    )
                elif by_lanes is not None:
                    started = time.perf_counter()
                    lanes = LaneHandoff(self.settings, self.plane, self.faults)
                    receiving = asyncio.create_task(lanes.receive(peer, by_lanes, asked_lanes, dst, plan, record))
                else:
                    staging, need = self.plane.staging_for(dst, plan, "receive")
                    lease = await stack.enter_async_context(staging.lease(need))
                    record.mark("staging")
                    started = time.perf_counter()
                    progress = LayerProgress(starts, record.on_layers) if starts and record.on_layers else None
                    receiving = asyncio.create_task(
                        self._receive(record, ep, dst, side, plan, tag_base, lease, progress)
                    )
                # The offerer's sent (or failure) comes while bytes land; a layer-wise direct read
                # reads it itself, after the offerer's last ready.
                if source is None or starts is None:
                    sent = asyncio.create_task(call.sent())
                    first, _ = await asyncio.wait({receiving, sent}, return_when=asyncio.FIRST_COMPLETED)
                    if receiving in first and receiving.exception() is not None and not sent.done():
                        # A direct read that failed may have seen the offerer's own failure
                        # first (it ended the transfer and let go of the nonce): its word,
                        # due within a moment, says why.
                        await asyncio.wait({sent}, timeout=OFFERER_WORD_S)
                    if sent.done() and (sent in first or sent.exception() is not None):
                        sent.result()  # the offerer failed (or aborted) while bytes were due: end now
                landed = await receiving
                record.data_plane_s = time.perf_counter() - started
                record.mark("received")
                # Every receive has completed, so every byte has landed (the tags are this
                # transfer's own). The offerer's "sent" carries the sums they are checked
                # against, before any reader hears of them.
                said = landed if sent is None else await within(sent, _left(ends_at), "the peer's 'sent'")
                sums = said.sums if isinstance(said, peer_pb2.TransferSent) and said.HasField("sums") else None
                await self.integrity.check_landed(record, sums, dst, dst_ids, plan if record.mapping else None)
                record.mark("checked")
                readers = 1 + (await hand_on() if hand_on is not None else 0)
                await self.faults.hit("before_done", transfer_id=record.transfer_id)
                record.committed = True  # the sender releases the offer as pulled on this message
                call.done(readers)
                # From here the offerer decides (peer.proto, "Outcomes"): closed is success,
                # failed is failure. Neither the pull's own deadline nor a step deadline may
                # decide instead, or a late closed would fail this side only; the transfer's
                # deadline, which the offerer also keeps, bounds the wait.
                deadline.reschedule(None)
                await self.faults.hit("before_closed_read", transfer_id=record.transfer_id)
                await call.closed(_left(ends_at))
                record.mark("closed")
            except BaseException as exc:
                if sent is not None and not sent.done():
                    sent.cancel()
                if receiving is not None and not receiving.done() and (source is not None or by_lanes is not None):
                    receiving.cancel()  # the copy threads stop at their next chunk; awaited there
                    await asyncio.wait({receiving})
                elif receiving is not None and not receiving.done():
                    await self._unwind(record, receiving, peer)
                    if lease is not None:
                        lease.poisoned = True
                call.abort(_why(exc))
                if record.committed and isinstance(exc, DeadlineExceededError):
                    raise DeadlineExceededError(
                        f"pull {record.transfer_id}: every byte landed, but {ticket.peer_address} did not close "
                        f"the transfer within its deadline of {transfer_deadline_s}s: both sides fail it"
                    ) from None
                if isinstance(exc, UnavailableError):
                    self.plane.drop_peer(peer)  # the next pull says Hello again and makes a new endpoint
                raise

    async def _read(
        self,
        record: TransferRecord,
        peer: Peer,
        source: peer_pb2.DirectReadSource,
        sender: common_pb2.LayoutSignature,
        dst: Pool,
        dst_ids: np.ndarray[Any, Any],
        plan: SidePlan,
        nonce: bytes,
        layered: tuple[TransferCall, list[int]] | None = None,
    ) -> peer_pb2.TransferSent | None:
        """Read the offered blocks out of the offering daemon's memory (:mod:`.direct`), once
        this transfer's nonce is found there; ``layered``: the transfer and where each layer's
        chunks start, when the offer is written layer by layer (each read once said written;
        the offerer's ``sent``, read here after its last ``ready``, is returned)."""
        why = nonce_missing(int(source.pid), int(source.nonce_address), nonce) if nonce else "it was not asked for"
        if why:
            raise IncompatibleError(f"peer {peer.daemon_id} answered with a direct read, but {why}")
        record.transport = DIRECT_READ
        layers = len(layered[1]) - 1 if layered is not None else 0
        src, src_plan = source_plan(source, sender, dst, dst_ids, plan.chunk_bytes, bool(record.mapping), layers)
        if src_plan.total_bytes != plan.total_bytes:
            raise IncompatibleError(f"peer lends {src_plan.total_bytes} bytes, destination expects {plan.total_bytes}")
        if [c.nbytes for c in src_plan.chunks] != [c.nbytes for c in plan.chunks]:
            raise IncompatibleError("the peer's blocks and the destination's cut into different chunks")
        record.mark("lent")
        threads = self.settings.copy_threads
        if layered is None:
            await copy_in_threads(self.executor, threads, (src, src_plan), (dst.host_memory(), plan), single_pass=False)
            return None
        call, starts = layered
        copied = 0
        while copied < layers:
            written = await call.ready()
            if not copied < written <= layers:
                raise UnavailableError(f"peer {peer.daemon_id} said {written} of {layers} layers are written")
            first, end = starts[copied], starts[written]
            parts = (src, sub_plan(src_plan, first, end)), (dst.host_memory(), sub_plan(plan, first, end))
            await copy_in_threads(self.executor, threads, *parts, single_pass=False)
            copied = written
            if record.on_layers is not None:
                record.on_layers(written)
        return await call.sent()

    def _receive(
        self,
        record: TransferRecord,
        ep: Any,
        dst: Pool,
        side: BlockSide | None,
        plan: SidePlan,
        tag_base: int,
        lease: StagingLease,
        progress: LayerProgress | None = None,
    ) -> Any:
        """The coroutine that receives every chunk of ``plan`` into ``dst`` (telling
        ``progress`` of each, for a layer-wise stream)."""
        if side is not None:
            copier = self._gpu().copier(side.device)
            uploaded = copier.upload_side(side)
            return self.ucx.receive_gpu(
                ep, plan, uploaded, copier, tag_base, lease, self.settings.window, mark=record.mark
            )
        return self.ucx.receive(
            ep,
            plan,
            dst.host_memory(),
            tag_base,
            lease,
            self.executor,
            self.settings.window,
            on_unconfirmed=lambda: setattr(record, "may_still_write", True),
            on_chunk=progress.chunk_landed if progress is not None else None,
        )

    async def _unwind(self, record: TransferRecord, receiving: asyncio.Task[Any], peer: Peer) -> None:
        """Receives may still be posted into the destination: cancel them (and abort the
        endpoint) and wait for UCX to confirm before the engine hears of the failure and
        reuses those blocks."""
        receiving.cancel()
        await asyncio.wait({receiving}, timeout=CANCEL_CONFIRM_S + 1.0)
        if not receiving.done():
            record.may_still_write = True  # not even the cancellation finished
        if not self.ucx.receives_cancel_alone:
            self.ucx.forget(peer.daemon_id)  # UCXX receives cancel only with it
        elif record.may_still_write:
            # UCX would not cancel a matched receive: closing the endpoint makes it give the
            # receive up (the next pull says Hello again).
            self.plane.drop_peer(peer)


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


def _receive_plan(dst: Pool, side: BlockSide | None, dst_ids: np.ndarray[Any, Any], chunk: int) -> SidePlan:
    """The destination's chunks: computed on the GPU for GPU pools, planned runs for host."""
    if side is not None:
        return stream_plan(side.total_bytes, chunk)
    return build_plan(dst.regions, dst_ids, chunk)
