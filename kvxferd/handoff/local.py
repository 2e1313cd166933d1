"""The local handoff: the offer and the destination are both on this daemon, so the bytes are
copied here, without UCX: host to host by the copy threads (one ``process_vm_readv/writev`` per
chunk, or two passes through scratch where the kernel refuses it or both sides are engines'
own process memory), anything touching a GPU by one kernel launch over every segment.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from kvxfer.errors import IncompatibleError
from kvxfer.layout import Layout, mapping_between, signature_mismatch
from kvxfer.proto import common_pb2

from .._offers import Offer, OfferTable
from .._services import Services
from .._transfers import TransferRecord, described
from ..dataplane.gpu_kernel import BlockSide
from ..dataplane.hostcopy import FEW_SEGMENTS, copy_few_blocks
from ..dataplane.plan import SidePlan, build_layered_plan, build_plan, sub_plan
from ..dataplane.remap import remap_plans
from ..dataplane.threaded_copy import copy_in_threads
from ..memory.pools import PROCESS_MEMORY_OFF_GPU, Pool
from ..transports.layers import layer_batches, layer_sizes
from .order import PullOrder

__all__ = ["LocalHandoff"]

#: Layout pairs whose comparison is remembered (pools come and go; each pair is a few bytes).
_PAIRS_KEPT = 256


class LocalHandoff:
    def __init__(self, services: Services, offers: OfferTable, single_pass: bool) -> None:
        """``single_pass``: host copies between two fragmented sides in one pass, by the kernel
        (the caller checked that the kernel allows it)."""
        self.offers = offers
        self.chunk_bytes = services.settings.local_chunk_bytes
        self.copy_threads = services.settings.copy_threads
        self.executor = services.executor
        self.single_pass = single_pass
        self._gpu = services.gpu
        self.faults = services.faults
        self.integrity = services.integrity
        #: (source layout, destination layout) → (what no mapping bridges, the mapping): every
        #: pull between two pools asks the same, and the answer cost ~40 µs of a 1 ms pull.
        self._pairs: dict[tuple[int, int], tuple[Layout, Layout, str | None, str]] = {}

    async def copy_offer(self, order: PullOrder) -> None:
        """Claim the ticket's offer, copy its blocks (those at ``indices`` of its list, or all)
        into ``dst_ids`` of ``dst``, release the offer as pulled (as failed when the copy did
        not finish)."""
        record, ticket, dst, dst_ids, indices = order.record, order.ticket, order.dst, order.dst_ids, order.indices
        offer = await self.offers.claim_soon(ticket.offer_id, ticket.token)
        record.transport = "local-copy"
        src = offer.pool
        try:
            mismatch, record.mapping = self._pairing(src.layout, dst.layout)
            if mismatch:
                raise IncompatibleError(f"incompatible layouts: {mismatch}")
            if (src.on_gpu or dst.on_gpu) and (src.process or dst.process):
                raise IncompatibleError(PROCESS_MEMORY_OFF_GPU)
            src_ids = offer.blocks_at(indices)
            if record.mapping and (src.on_gpu or dst.on_gpu):
                raise IncompatibleError(f"GPU pools move blocks as they are; this pull needs {record.mapping}")
            # Off the event loop: a large remap plans for tens of milliseconds (numpy lets go of
            # the GIL for most of it), and other handoffs' messages should not wait on it.
            plans = (
                await asyncio.to_thread(remap_plans, src, src_ids, dst, dst_ids, self.chunk_bytes)
                if record.mapping
                else None
            )
        except BaseException:
            self.offers.unclaim(offer)  # refused before anything moved: the offer stays pullable
            raise
        checked = False  # by checked_as_copied, as a few blocks landed
        try:
            await self.faults.hit("before_local_copy", transfer_id=record.transfer_id)
            on_host = not (src.on_gpu or dst.on_gpu)
            if offer.layers and on_host and plans is None:
                # Written layer by layer: copy each layer once the engine says it is written.
                await self._copy_layers(offer, src, src_ids, dst, dst_ids, record)
            else:
                await offer.wait_ready(offer.layers)  # a layer-wise offer moving whole: once written
                started = time.perf_counter()
                if plans is None and on_host and _few(src, dst, len(src_ids)):
                    landing = dst_ids.tolist()
                    with src.in_use():
                        record.nbytes = copy_few_blocks(
                            src.arrays, src.regions, src_ids.tolist(), dst.arrays, dst.regions, landing
                        )
                    checked = self.integrity.checked_as_copied(record, offer, indices, dst, landing)
                else:
                    plans = plans or (self._plans(src, src_ids, dst, dst_ids) if on_host else None)
                    record.nbytes = plans[0].total_bytes if plans else len(src_ids) * src.layout.bytes_per_block
                    transport, record.device_s = await self.copy_blocks(src, src_ids, dst, dst_ids, plans)
                    record.transport = transport or record.transport
                record.data_plane_s = time.perf_counter() - started
            # As offered: a remapped stream is summed at the source and where it landed, by
            # windows of the stream; blocks as they are, where they landed against the digest.
            if record.mapping and plans is not None:
                sums = await self.integrity.to_send(record, offer, indices, plans[0])
                if sums is not None and len(sums.sums):
                    await self.integrity.check_landed(record, sums, dst, dst_ids, plans[1])
            elif not checked:
                await self.integrity.check_local(record, offer, indices, dst, dst_ids)
            record.mark("checked")
        except BaseException as exc:
            detail = f"local pull failed: {described(exc)}"
            self.offers.release(offer, common_pb2.RELEASE_REASON_FAILED, detail, record.transfer_id)
            raise
        self.offers.pulled(offer, record.transfer_id)

    def _pairing(self, src: Layout, dst: Layout) -> tuple[str | None, str]:
        """What no mapping bridges between two layouts (None: blocks can move), and how blocks
        are remapped ("": as they are); remembered per pair of layouts (both held)."""
        key = (id(src), id(dst))
        kept = self._pairs.get(key)
        if kept is None or kept[0] is not src or kept[1] is not dst:
            ours, theirs = src.signature(), dst.signature()
            mismatch = signature_mismatch(ours, theirs)
            kept = (src, dst, mismatch, "" if mismatch else mapping_between(ours, theirs))
            if len(self._pairs) >= _PAIRS_KEPT:
                self._pairs.clear()
            self._pairs[key] = kept
        return kept[2], kept[3]

    async def _copy_layers(
        self,
        offer: Offer,
        src: Pool,
        src_ids: np.ndarray[Any, Any],
        dst: Pool,
        dst_ids: np.ndarray[Any, Any],
        record: TransferRecord,
    ) -> None:
        layers = offer.layers
        src_plan, starts = build_layered_plan(src.regions, src_ids, self.chunk_bytes, layers)
        dst_plan, _ = build_layered_plan(dst.regions, dst_ids, self.chunk_bytes, layers)
        record.nbytes = src_plan.total_bytes
        sizes = layer_sizes([r.block_bytes for r in src.layout.regions], len(src_ids), layers)
        started = time.perf_counter()
        with src.in_use():
            async for first, end in layer_batches(offer, sizes, 0):
                a, b = starts[first], starts[end]
                await self._copy_host(src, sub_plan(src_plan, a, b), dst, sub_plan(dst_plan, a, b))
                if record.on_layers is not None:
                    record.on_layers(end)
        record.data_plane_s = time.perf_counter() - started

    async def copy_blocks(
        self,
        src: Pool,
        src_ids: np.ndarray[Any, Any],
        dst: Pool,
        dst_ids: np.ndarray[Any, Any],
        plans: tuple[SidePlan, SidePlan] | None = None,
    ) -> tuple[str, float]:
        """Copy blocks between two pools, no offer involved (a pull, or a shared remote read
        handing its bytes on: :mod:`.shared`); ``plans``: both host sides' plans where made
        already (a remap). Returns the GPU copy's transport and GPU time ("" and 0 on host)."""
        if (src.on_gpu or dst.on_gpu) and (src.process or dst.process):
            raise IncompatibleError(PROCESS_MEMORY_OFF_GPU)
        with src.in_use():
            if src.on_gpu or dst.on_gpu:
                return await self._copy_gpu(src, src_ids, dst, dst_ids)
            src_plan, dst_plan = plans or self._plans(src, src_ids, dst, dst_ids)
            await self._copy_host(src, src_plan, dst, dst_plan)
            return "", 0.0

    def _plans(
        self, src: Pool, src_ids: np.ndarray[Any, Any], dst: Pool, dst_ids: np.ndarray[Any, Any]
    ) -> tuple[SidePlan, SidePlan]:
        return build_plan(src.regions, src_ids, self.chunk_bytes), build_plan(dst.regions, dst_ids, self.chunk_bytes)

    async def _copy_host(self, src: Pool, src_plan: SidePlan, dst: Pool, dst_plan: SidePlan) -> None:
        await copy_in_threads(
            self.executor,
            self.copy_threads,
            (src.host_memory(), src_plan),
            (dst.host_memory(), dst_plan),
            self.single_pass,
        )

    async def _copy_gpu(
        self, src: Pool, src_ids: np.ndarray[Any, Any], dst: Pool, dst_ids: np.ndarray[Any, Any]
    ) -> tuple[str, float]:
        """One kernel launch over every segment (a host side is pinned and read over PCIe);
        returns the transport and the copy's GPU time."""
        device = dst.device if dst.device is not None else src.device
        assert device is not None
        for pool in (src, dst):
            pool.pin_for_gpu()
        src_dev = src.device if src.device is not None else device
        return await self._gpu().copy_local(
            BlockSide.of(src_dev, src.base, src.regions, src_ids),
            BlockSide.of(device, dst.base, dst.regions, dst_ids),
        )


def _few(src: Pool, dst: Pool, blocks: int) -> bool:
    """Both pools are mapped here and the copy is a few segments (:data:`FEW_SEGMENTS`)."""
    return src.process is None and dst.process is None and len(src.layout.regions) * blocks <= FEW_SEGMENTS
