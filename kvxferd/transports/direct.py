"""Same-host direct reads, both ends: the decode daemon reads the offered blocks straight out
of the offering daemon's memory (``process_vm_readv``) once it found this transfer's nonce
there (:mod:`.direct_proof` says why that proves it may), layer by layer for an offer still
being written; the offering daemon lends them (says where they are) and does no work per
byte."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvxfer.errors import IncompatibleError, UnavailableError
from kvxfer.proto import peer_pb2

from .._folded_sums import fold_windows
from .._services import Services
from ..dataplane.hostcopy import FEW_SEGMENTS, scatter_few_blocks
from ..dataplane.hostmem import MappedMemory
from ..dataplane.plan import sub_plan
from ..dataplane.remap import side_of
from ..dataplane.segment_reads import read_rows, segment_rows
from ..dataplane.threaded_copy import copy_in_threads
from ..memory.pools import Pool
from .direct_proof import DIRECT_READ, lent_rows, lent_segments, nonce_missing, source_plan
from .faces import Landing, Receiver, Sender, Sending
from .layers import layer_batches, layer_sizes
from .plane import RemotePlane

__all__ = ["DirectRead", "Lend", "reads_alike"]

#: Segments up to this size are read segment to segment; larger ones (a contiguous cache's
#: few big segments) by the chunk plan, which cuts them so that every copy thread gets a share.
ROW_BYTES = 4 << 20


def reads_alike(dst: Pool) -> bool:
    """Whether a direct read of blocks laid out alike lands in ``dst`` segment to segment,
    with no plan on either side: host memory mapped here, in segments that the copy threads
    can share (none over :data:`ROW_BYTES`)."""
    return dst.device is None and dst.process is None and int(dst.regions.nbytes.max()) <= ROW_BYTES


class DirectRead(Receiver):
    def __init__(
        self, landing: Landing, services: Services, source: peer_pb2.DirectReadSource, nonce: bytes, sender: Any
    ) -> None:
        super().__init__(landing, services)
        self.source, self.nonce, self.sender = source, nonce, sender
        self.reads_sent = landing.starts is not None

    async def land(self) -> peer_pb2.TransferSent | None:
        """Read the offered blocks once this transfer's nonce is found in the offering daemon;
        layer by layer (each once said written) where the offer is written so."""
        t, nonce, source = self.landing, self.nonce, self.source
        if nonce and self._few():
            self._read_few()
            return None
        why = nonce_missing(int(source.pid), int(source.nonce_address), nonce) if nonce else "it was not asked for"
        if why:
            raise IncompatibleError(f"peer {t.peer.daemon_id} answered with a direct read, but {why}")
        t.record.transport = DIRECT_READ
        if self._alike():
            await self._read_rows()
            return None
        layers = len(t.starts) - 1 if t.starts is not None else 0
        remap_to = side_of(t.dst.layout, t.dst.regions, t.dst_ids) if t.record.mapping else None
        src, src_plan = source_plan(source, self.sender, t.plan.chunk_bytes, remap_to, layers)
        if src_plan.total_bytes != t.plan.total_bytes:
            raise IncompatibleError(
                f"peer lends {src_plan.total_bytes} bytes, destination expects {t.plan.total_bytes}"
            )
        if [c.nbytes for c in src_plan.chunks] != [c.nbytes for c in t.plan.chunks]:
            raise IncompatibleError("the peer's blocks and the destination's cut into different chunks")
        t.record.mark("lent")
        executor, threads = self.services.executor, self.services.settings.copy_threads
        if t.starts is None:
            await copy_in_threads(executor, threads, (src, src_plan), (t.dst.host_memory(), t.plan), single_pass=False)
            return None
        copied = 0
        while copied < layers:
            written = await t.call.ready()
            if not copied < written <= layers:
                raise UnavailableError(f"peer {t.peer.daemon_id} said {written} of {layers} layers are written")
            first, end = t.starts[copied], t.starts[written]
            parts = (src, sub_plan(src_plan, first, end)), (t.dst.host_memory(), sub_plan(t.plan, first, end))
            await copy_in_threads(executor, threads, *parts, single_pass=False)
            copied = written
            if t.record.on_layers is not None:
                t.record.on_layers(written)
        return await t.call.sent()

    def _few(self) -> bool:
        """A whole read of a few blocks, as they are, into memory mapped here."""
        t = self.landing
        segments = len(t.dst.regions.nbytes) * len(t.dst_ids)
        plain = t.starts is None and not t.record.mapping and t.dst.process is None
        return plain and segments <= FEW_SEGMENTS and len(self.source.block_ids) == len(t.dst_ids)

    def _alike(self) -> bool:
        """A whole read (not layer by layer) of blocks laid out alike on both sides (not
        remapped), into a destination :func:`reads_alike` reads."""
        t = self.landing
        return t.starts is None and not t.record.mapping and reads_alike(t.dst)

    async def _read_rows(self) -> None:
        """The lent segments read into the destination's, segment to segment (no plans:
        :mod:`..dataplane.segment_reads`)."""
        t = self.landing
        memory, remote = lent_rows(self.source, self.sender)
        here = t.dst.host_memory()
        assert isinstance(here, MappedMemory)  # a pool of no engine's process is mapped here
        local = segment_rows(here.bases, t.dst.regions, t.dst_ids)
        if len(remote) != len(local) or not np.array_equal(remote[:, 1], local[:, 1]):
            raise IncompatibleError(f"peer {t.peer.daemon_id} lends other segments than the destination's")
        folded = fold_windows(self.said_sums, here, t.dst.regions, t.dst_ids)
        t.record.mark("lent")
        threads, landed = self.services.settings.copy_threads, folded.landed if folded is not None else None
        await read_rows(self.services.executor, threads, memory, local, remote, landed)
        if folded is not None:
            folded.done = True
            self.folded = folded

    def _read_few(self) -> None:
        """The nonce and the blocks in one read, into scratch; laid into the destination once
        the nonce was found (a one-block pull: one call instead of two, and no plans)."""
        t, source = self.landing, self.source
        segments = lent_segments(source, self.sender)
        scratch = np.empty(sum(n for _, n in segments), dtype=np.uint8)
        if scratch.nbytes != t.plan.total_bytes:
            raise IncompatibleError(f"peer lends {scratch.nbytes} bytes, destination expects {t.plan.total_bytes}")
        why = nonce_missing(int(source.pid), int(source.nonce_address), self.nonce, segments, scratch)
        if why:
            raise IncompatibleError(f"peer {t.peer.daemon_id} answered with a direct read, but {why}")
        t.record.transport = DIRECT_READ
        t.record.mark("lent")
        scatter_few_blocks(t.dst.arrays, t.dst.regions, t.dst_ids.tolist(), scratch)


class Lend(Sender):
    def __init__(self, sending: Sending, services: Services, plane: RemotePlane, lent: Any) -> None:
        super().__init__(sending, services, plane)
        self.lent = lent

    async def send(self) -> None:
        t, settings = self.sending, self.services.settings
        source, _nonce_held = self.lent  # the nonce's memory is held by this sender (see serve)
        t.record.transport = DIRECT_READ
        await self.accepted(direct=source, layers=t.layers)
        t.record.mark("lent")
        if t.layers:
            pool = t.offer.pool
            sizes = layer_sizes([r.block_bytes for r in pool.layout.regions], len(t.src_ids), t.layers)
            batch = settings.layerwise_batch_bytes if t.per_layer else float("inf")
            async for _, written in layer_batches(t.offer, sizes, batch):
                await t.stream.ready(written)
