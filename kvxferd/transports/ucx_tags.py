"""UCX tagged messages, both ends: every chunk of a transfer is one message with tag
``tag_base | chunk``, received into a receive posted ahead (``window`` at once) straight into
the pool where UCX can scatter, else through staging (host) or a kernel (GPU); sent from the
pool where UCX can gather, else packed into staging; per layer for a layer-wise offer."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from kvxfer.errors import UnavailableError

from .._services import Services
from ..dataplane.gpu_kernel import BlockSide
from ..dataplane.pipeline import ChunkFlow
from ..dataplane.plan import SidePlan, build_layered_plan, build_plan, sub_plan
from ..dataplane.staging import StagingLease
from ..dataplane.ucp_iov import CANCEL_CONFIRM_S
from ..dataplane.ucx import TagStream
from .faces import Landing, Receiver, Sender
from .layers import LayerProgress, layer_sizes, send_by_layer
from .plane import RemotePlane

__all__ = ["UcxReceive", "UcxSend"]


class UcxReceive(Receiver):
    """Receives posted ahead (``window`` at once), tag ``tag_base | chunk`` each."""

    def __init__(self, landing: Landing, services: Services, plane: RemotePlane, endpoint: Any, tag_base: int) -> None:
        super().__init__(landing, services)
        self.plane, self.endpoint, self.tag_base = plane, endpoint, tag_base
        self.lease: StagingLease | None = None

    async def land(self) -> None:
        assert self.lease is not None, "enter the staging lease first (staging)"
        t, s = self.landing, self.services
        ucx = self.plane.ucx
        stream = TagStream(self.endpoint, self.tag_base, ChunkFlow(t.plan, self.lease, s.settings.window))
        side = BlockSide.of(t.dst.device, t.dst.base, t.dst.regions, t.dst_ids) if t.dst.device is not None else None
        if side is not None:
            copier = s.gpu().copier(side.device)
            await ucx.receive_gpu(stream, copier.upload_side(side), copier, mark=t.record.mark)
            return
        progress = LayerProgress(t.starts, t.record.on_layers) if t.starts and t.record.on_layers else None
        await ucx.receive(
            stream,
            t.dst.host_memory(),
            s.executor,
            on_unconfirmed=lambda: setattr(t.record, "may_still_write", True),
            on_chunk=progress.chunk_landed if progress is not None else None,
        )

    async def prepare(self, stack: contextlib.AsyncExitStack) -> None:
        """Lease the staging buffers this pull's chunks land in (held until the pull ends)."""
        staging, need = self.plane.staging_for(self.landing.dst, self.landing.plan, "receive")
        self.lease = await stack.enter_async_context(staging.lease(need))
        self.landing.record.mark("staging")

    async def stop(self) -> None:
        """Receives may still be posted into the destination: cancel them (and abort the
        endpoint) and wait for UCX to confirm before the engine hears of the failure and
        reuses those blocks."""
        if self.task is None or self.task.done():
            return
        t, ucx = self.landing, self.plane.ucx
        self.task.cancel()
        await asyncio.wait({self.task}, timeout=CANCEL_CONFIRM_S + 1.0)
        if not self.task.done():
            t.record.may_still_write = True  # not even the cancellation finished
        if not ucx.receives_cancel_alone:
            ucx.abort_endpoint(t.peer.daemon_id)  # UCXX receives cancel only with it
        elif t.record.may_still_write:
            # UCX would not cancel a matched receive: closing the endpoint makes it give the
            # receive up (the next pull says Hello again).
            self.plane.drop_peer(t.peer)
        if self.lease is not None:
            self.lease.poisoned = True


class UcxSend(Sender):
    """Every chunk over UCX once written: layer by layer for a layer-wise offer moving per
    layer, else whole."""

    async def send(self) -> None:
        t, s = self.sending, self.services
        ucx, pool = self.plane.ucx, t.offer.pool
        starts = None
        if t.per_layer:
            t.plan, starts = build_layered_plan(pool.regions, t.src_ids, t.chunk, t.layers)
        ep = await self.plane.endpoint(t.peer)
        try:
            await s.faults.hit("endpoint_broken", transfer_id=t.record.transfer_id, peer=t.peer.daemon_id)
        except UnavailableError:
            ucx.break_endpoint(ep)  # the send below fails, and so would every later one
        staging, need = self.plane.staging_for(pool, t.plan, "send")
        async with staging.lease(need) as lease:
            t.record.mark("staging")
            await self.accepted(direct=None, layers=t.layers if starts is not None else 0)
            # UCX gathers from the pool: planned while the receiver posts receives.
            plan = t.plan or build_plan(pool.regions, t.src_ids, t.chunk)
            t.record.mark("planned")
            if starts is not None:
                await self._send_by_layer(ep, lease, plan, starts)
                return
            await t.offer.wait_ready(t.offer.layers)  # a layer-wise offer moving whole: once written
            stream = TagStream(ep, t.start.tag_base, ChunkFlow(plan, lease, s.settings.window))
            if t.side is not None:
                copier = s.gpu().copier(t.side.device)
                await ucx.send_gpu(stream, copier.upload_side(t.side), copier, mark=t.record.mark)
                return
            fault = self.plane.chunk_fault(t.record.transfer_id)
            await ucx.send(stream, pool.host_memory(), after_chunk=fault)

    async def _send_by_layer(self, ep: Any, lease: Any, plan: SidePlan, starts: list[int]) -> None:
        t, s = self.sending, self.services
        ucx, pool = self.plane.ucx, t.offer.pool
        sizes = layer_sizes([r.block_bytes for r in pool.layout.regions], len(t.src_ids), t.layers)

        async def send(first: int, end: int) -> None:
            part = sub_plan(plan, starts[first], starts[end])
            fault = self.plane.chunk_fault(t.record.transfer_id)
            stream = TagStream(ep, t.start.tag_base, ChunkFlow(part, lease, s.settings.window))
            await ucx.send(stream, pool.host_memory(), after_chunk=fault)

        # Batches in flight together where none packs into the one staging lease.
        overlap = ucx.gather_send and pool.process is None
        await send_by_layer(t.offer, sizes, s.settings.layerwise_batch_bytes, send, overlap)
