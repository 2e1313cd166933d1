"""GPU copies: one CuPy kernel launch moves any number of segments.

The host never lists segments. Per handoff it uploads one small table — each region's first
address, block stride, segment size and position in the stream, then the block ids — and the
kernels compute every address on the GPU. The local path writes that table into a slot of a
pinned host ring and uploads it with one asynchronous copy (a pageable upload blocks the host
for about 30 µs, which is a sixth of a 256 MiB copy on an H100). CUDA block ``(x, y)`` copies
piece ``y`` (at most ``piece`` bytes) of segment ``x``, with 16-byte loads and stores when
both ends share an alignment and a byte loop otherwise. The Python work per handoff is
O(regions + blocks) numpy plus one launch per chunk; it never grows with the number of
segments.

* :func:`launch_blocks` (``kvxfer_copy_blocks``): the local path, pool → pool, one launch.
* :meth:`GpuCopier.launch_stream` (``kvxfer_copy_stream``): one chunk of a side's byte
  stream between the pool and a staging buffer (gather before a UCX send, scatter after a
  receive). Segments are listed region-major, then in the handoff's block order; the chunk is
  the stream range ``[c * chunk_bytes, (c + 1) * chunk_bytes)``.

Completion is a CUDA event polled from the event loop (never a blocking synchronise on the
loop thread).

The kernels and the tables they read are in :mod:`.gpu_kernel`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .gpu_kernel import KERNEL_SOURCE, MAX_PIECE, BlockSide, KernelConfig, piece_for
from .staging import StagingPool

__all__ = ["GpuCopier", "GpuDevices", "GpuLaunch", "UploadedSide", "launch_blocks", "settle", "wait_event"]

I64 = npt.NDArray[np.int64]


@dataclass
class UploadedSide:
    """A side's table on the GPU, ready for one :meth:`GpuCopier.launch_stream` per chunk."""

    side: BlockSide
    table: Any  # cupy int64 array


@dataclass(frozen=True)
class GpuLaunch:
    """A launch's events on the copier's stream: ``done`` completes with the copy, and
    :meth:`device_s` is the GPU time from the table upload to the kernel's end."""

    started: Any
    done: Any

    def device_s(self) -> float:
        """GPU seconds of the upload and copy; call once ``done`` has completed."""
        from cupy.cuda import get_elapsed_time

        return float(get_elapsed_time(self.started, self.done)) / 1e3


class _TableRing:
    """Pinned host slots and matching device slots for per-launch tables.

    A slot is written on the host, copied with one ``cudaMemcpyAsync`` on the copier's stream
    (ordered before the kernel that reads it) and reused only once the event recorded after
    that kernel has completed, so neither copy can be overwritten while in use.
    """

    def __init__(self, cupy: Any, stream: Any, slots: int = 64, slot_words: int = 8192) -> None:
        self._cp = cupy
        self._stream = stream
        self.slot_words = slot_words
        nbytes = slots * slot_words * 8
        self._host_mem = cupy.cuda.alloc_pinned_memory(nbytes)
        self._host = np.frombuffer(self._host_mem, dtype=np.int64, count=slots * slot_words).reshape(slots, -1)
        self._device = cupy.empty(slots * slot_words, dtype=cupy.int64)
        self._busy: list[Any] = [None] * slots
        self._next = 0
        self._last = -1

    def write(self, *tables: I64) -> tuple[int, int] | None:
        """Write ``tables`` back to back into the next free slot on the host; returns
        ``(slot, words)`` for :meth:`send`, or None when they do not fit in a slot."""
        words = sum(len(t) for t in tables)
        if words > self.slot_words:
            return None
        i = self._next
        self._next = (i + 1) % len(self._busy)
        pending = self._busy[i]
        if pending is not None and not pending.done:
            pending.synchronize()  # only when every slot is in flight: 64 launches behind
        np.concatenate(tables, out=self._host[i, :words])
        return i, words

    def send(self, slot: tuple[int, int]) -> int:
        """Queue the slot's upload on the stream; returns the tables' device address."""
        i, words = slot
        device = self._device.data.ptr + i * self.slot_words * 8
        runtime = self._cp.cuda.runtime
        runtime.memcpyAsync(device, self._host[i].ctypes.data, words * 8, runtime.memcpyHostToDevice, self._stream.ptr)
        self._last = i
        return int(device)

    def used_until(self, event: Any) -> None:
        """The slot of the last upload is free again once ``event`` has completed."""
        if self._last >= 0:
            self._busy[self._last] = event
            self._last = -1


class GpuCopier:
    """Launches the copy kernels on one device, on the daemon's own stream."""

    def __init__(self, device: int, config: KernelConfig | None = None) -> None:
        import cupy

        self._cp = cupy
        self.device = device
        self.config = config = config or KernelConfig()
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
            options = (f"-DUNROLL={config.unroll}", f"-DSTREAMING={int(config.streaming)}")
            module = cupy.RawModule(code=KERNEL_SOURCE, options=options)
            self._blocks = module.get_function("kvxfer_copy_blocks")
            self._stream_kernel = module.get_function("kvxfer_copy_stream")
            self._ring = _TableRing(cupy, self.stream)

    def _upload(self, table: I64) -> Any:
        # Allocated and copied on this stream, so ordered before the kernels that read it (a
        # non-blocking stream does not wait for the default stream); CuPy's pool reuses the
        # memory only for later work on the same stream once the array is dropped.
        with self._cp.cuda.Device(self.device), self.stream:
            return self._cp.asarray(np.ascontiguousarray(table, dtype=np.int64))

    def _event(self, timing: bool = False) -> Any:
        event = self._cp.cuda.Event(block=False, disable_timing=not timing)
        event.record(self.stream)
        return event

    def launch_blocks(self, src: BlockSide, dst: BlockSide, piece: int = MAX_PIECE) -> GpuLaunch:
        """Copy every block of ``src`` to ``dst`` in one launch; returns its events."""
        if not np.array_equal(src.nbytes, dst.nbytes) or len(src.ids) != len(dst.ids):
            raise ValueError("source and destination differ in segment sizes or block count")
        piece, per_segment = piece_for(int(src.nbytes.max()), piece)
        nreg, nblk = len(src.nbytes), len(src.ids)
        s_table, d_table = src.table(), dst.table()
        with self._cp.cuda.Device(self.device):
            slot = self._ring.write(s_table, d_table)
            started = self._event(timing=True)
            if slot is None:  # tables larger than a ring slot: a plain (blocking) upload
                s_arg, d_arg = self._upload(s_table), self._upload(d_table)
            else:
                device = self._ring.send(slot)
                s_arg, d_arg = np.uint64(device), np.uint64(device + 8 * len(s_table))
            self._blocks(
                (nreg * nblk, per_segment),
                (self.config.threads,),
                (s_arg, d_arg, np.int64(nreg), np.int64(nblk), np.int64(piece)),
                stream=self.stream,
            )
            done = self._event(timing=True)
            self._ring.used_until(done)
            return GpuLaunch(started, done)

    def upload_side(self, side: BlockSide) -> UploadedSide:
        return UploadedSide(side, self._upload(side.table()))

    def launch_stream(self, up: UploadedSide, chunk: int, chunk_bytes: int, staging_ptr: int, to_staging: bool) -> Any:
        """Gather chunk ``chunk`` of the side's stream into staging (``to_staging``) or
        scatter it from staging into the pool; returns the completion event."""
        side = up.side
        lo = chunk * chunk_bytes
        hi = min(lo + chunk_bytes, side.total_bytes)
        if lo >= hi:
            raise ValueError(f"chunk {chunk} is past the end of the stream")
        g0, g1 = side.segments_overlapping(lo, hi)
        piece, per_segment = piece_for(int(side.nbytes.max()))
        with self._cp.cuda.Device(self.device):
            self._stream_kernel(
                (g1 - g0, per_segment),
                (self.config.threads,),
                (
                    up.table,
                    np.int64(len(side.nbytes)),
                    np.int64(len(side.ids)),
                    np.int64(piece),
                    np.int64(g0),
                    np.int64(lo),
                    np.int64(hi),
                    np.int64(staging_ptr),
                    np.int32(1 if to_staging else 0),
                ),
                stream=self.stream,
            )
            return self._event()


def launch_blocks(copier: GpuCopier, src: BlockSide, dst: BlockSide, piece: int = MAX_PIECE) -> GpuLaunch:
    """One launch copying every block of ``src`` to ``dst`` (see :meth:`GpuCopier.launch_blocks`)."""
    return copier.launch_blocks(src, dst, piece)


async def wait_event(event: Any, spin_s: float = 0.005) -> None:
    """Wait for a CUDA event without blocking the event loop: yield-and-poll for up to
    ``spin_s`` (a 256 MiB copy takes about 0.2 ms on an H100, and the loop's timers tick in
    whole milliseconds, so any sleep would cost more than the copy), then 1 ms sleeps."""
    if event.done:
        return
    spin_until = time.perf_counter() + spin_s
    while not event.done:  # noqa: ASYNC110 - a CUDA event cannot wake the loop
        await asyncio.sleep(0 if time.perf_counter() < spin_until else 0.001)


async def settle(event: Any) -> None:
    """Wait for ``event``; when cancelled meanwhile, still wait before re-raising: the kernel
    may be writing memory that the caller's caller is about to hand back."""
    try:
        await wait_event(event)
    except asyncio.CancelledError:
        event.synchronize()  # bounded by one kernel (well under a millisecond per 256 MiB)
        raise


class GpuDevices:
    """The daemon's per-GPU state: a copier, bounded staging for each direction, and which
    device pairs have peer access."""

    def __init__(self, staging_bytes: int, buffer_bytes: int) -> None:
        import cupy

        self._cp = cupy
        self._staging_bytes = staging_bytes
        self.buffer_bytes = buffer_bytes
        self._copiers: dict[int, GpuCopier] = {}
        self._staging: dict[tuple[int, str], StagingPool] = {}
        self._peer: dict[tuple[int, int], bool] = {}

    def copier(self, device: int) -> GpuCopier:
        copier = self._copiers.get(device)
        if copier is None:
            copier = self._copiers[device] = GpuCopier(device)
        return copier

    def staging(self, device: int, direction: str) -> StagingPool:
        """GPU staging of ``device`` for ``direction`` ("send" or "receive"), made on first use."""
        pool = self._staging.get((device, direction))
        if pool is None:
            cp = self._cp

            def allocate(nbytes: int) -> Any:
                with cp.cuda.Device(device):
                    buf = cp.zeros(nbytes, dtype=cp.uint8)
                    # Zeroed on the default stream, then used from the copier's non-blocking
                    # stream and by UCX: finish the zeroing first.
                    cp.cuda.get_current_stream().synchronize()
                    return buf

            pool = self._staging[(device, direction)] = StagingPool(self._staging_bytes, self.buffer_bytes, allocate)
        return pool

    def staging_pools(self, direction: str) -> list[StagingPool]:
        return [pool for (_, d), pool in self._staging.items() if d == direction]

    def peer_ok(self, dst: int, src: int) -> bool:
        """Whether kernels on ``dst`` can read ``src``'s memory (peer access, enabled here)."""
        if dst == src:
            return True
        key = (dst, src)
        ok = self._peer.get(key)
        if ok is None:
            rt = self._cp.cuda.runtime
            ok = bool(rt.deviceCanAccessPeer(dst, src))
            if ok:
                with self._cp.cuda.Device(dst):
                    try:
                        rt.deviceEnablePeerAccess(src)
                    except rt.CUDARuntimeError as exc:
                        ok = "PeerAccessAlreadyEnabled" in str(exc)
            self._peer[key] = ok
        return ok

    async def copy_local(self, src: BlockSide, dst: BlockSide) -> tuple[str, float]:
        """Copy one handoff between two mapped pools; returns the transport used and the GPU
        time of the copy (0.0 where it is not measured).

        A host pool has been pinned and its side names the GPU of the other. Same GPU or peer
        access: one launch on the destination's GPU. Otherwise each chunk goes gather (source
        GPU) → device-to-device copy → scatter (destination GPU) through staging.
        """
        if self.peer_ok(dst.device, src.device):
            launch = self.copier(dst.device).launch_blocks(src, dst)
            await settle(launch.done)
            transport = "local-kernel" if src.device == dst.device else "local-kernel:p2p"
            return transport, launch.device_s()
        await self._copy_staged(src, dst)
        return "local-kernel:staged", 0.0

    async def _copy_staged(self, src: BlockSide, dst: BlockSide) -> None:
        cp = self._cp
        chunk = self.buffer_bytes
        gather, scatter = self.copier(src.device), self.copier(dst.device)
        up_src, up_dst = gather.upload_side(src), scatter.upload_side(dst)
        async with (
            self.staging(src.device, "send").lease(1) as out,
            self.staging(dst.device, "receive").lease(1) as into,
        ):
            sbuf, dbuf = out.buffers[0], into.buffers[0]
            for c in range(-(-src.total_bytes // chunk)):
                nbytes = min(chunk, src.total_bytes - c * chunk)
                await settle(gather.launch_stream(up_src, c, chunk, sbuf.data.ptr, to_staging=True))
                with cp.cuda.Device(dst.device):
                    cp.cuda.runtime.memcpyPeerAsync(
                        dbuf.data.ptr, dst.device, sbuf.data.ptr, src.device, nbytes, scatter.stream.ptr
                    )
                await settle(scatter.launch_stream(up_dst, c, chunk, dbuf.data.ptr, to_staging=False))
