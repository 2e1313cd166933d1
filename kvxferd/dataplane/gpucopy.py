"""GPU copies: one CuPy RawKernel launch moves any number of segments.

A handoff's segments become *pieces* (address, length) computed with numpy, uploaded to the
GPU in one copy, and copied by one launch of :data:`KERNEL_SOURCE`: CUDA block *i* copies
piece *i* (grid-stride), with 16-byte loads and stores when both ends and the length allow it,
and a byte loop for whatever is not aligned. Pieces are at most :data:`MAX_PIECE` bytes so
that large contiguous segments still spread over every SM.

The same kernel serves three jobs, through a bias added to one side's addresses:

* local path: pool → pool (both mapped in the daemon, same GPU or peer-accessible GPUs);
* remote send: pool → staging (the piece's stream position + the staging address);
* remote receive: staging → pool.

Completion is a CUDA event polled from the event loop (never a blocking synchronise on the
loop thread). The Python work per handoff is numpy arithmetic plus one launch per chunk; it
does not grow with the number of segments.

>>> import numpy as np
>>> owner, start, length = cut(np.array([0, 100]), np.array([100, 60]), 64)
>>> owner.tolist(), start.tolist(), length.tolist()
([0, 0, 1, 1], [0, 64, 100, 128], [64, 36, 28, 32])
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .plan import RegionTable
from .staging import StagingPool

__all__ = [
    "KERNEL_SOURCE",
    "MAX_PIECE",
    "BlockSide",
    "GpuCopier",
    "GpuDevices",
    "KernelConfig",
    "PieceTable",
    "cut",
    "launch_blocks",
    "segment_addresses",
    "settle",
    "wait_event",
]

I64 = npt.NDArray[np.int64]

#: Largest piece one CUDA block copies: 64 KiB is 16 loads of 16 bytes per thread of 256.
MAX_PIECE = 64 << 10
THREADS = 256
MAX_GRID = 1 << 20

KERNEL_SOURCE = r"""
#ifndef UNROLL
#define UNROLL 4
#endif
#ifndef STREAMING
#define STREAMING 0
#endif
__device__ __forceinline__ uint4 load16(const uint4* p) {
#if STREAMING
    return __ldcs(p);
#else
    return *p;
#endif
}
__device__ __forceinline__ void store16(uint4* p, uint4 v) {
#if STREAMING
    __stcs(p, v);
#else
    *p = v;
#endif
}
// Copies L bytes: 16-byte words when both ends share an alignment, bytes otherwise.
__device__ __forceinline__ void copy_bytes(const unsigned char* s, unsigned char* d, long long L)
{
    long long head = 0;
    if ((((unsigned long long)s ^ (unsigned long long)d) & 15) == 0) {
        head = (16 - ((unsigned long long)s & 15)) & 15;
        if (head > L) head = L;
        for (long long i = threadIdx.x; i < head; i += blockDim.x) d[i] = s[i];
        const uint4* s4 = (const uint4*)(s + head);
        uint4* d4 = (uint4*)(d + head);
        long long m = (L - head) >> 4;
        long long i = threadIdx.x;
        const long long step = blockDim.x;
        // UNROLL loads in flight per thread before the stores: HBM needs the parallelism.
        for (; i + (UNROLL - 1) * step < m; i += UNROLL * step) {
            uint4 r[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) r[u] = load16(s4 + i + u * step);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) store16(d4 + i + u * step, r[u]);
        }
        for (; i < m; i += step) store16(d4 + i, load16(s4 + i));
        head += m << 4;
    }
    for (long long i = head + threadIdx.x; i < L; i += blockDim.x) d[i] = s[i];
}

// Pieces listed explicitly: piece p is len[p] bytes from src[p] + src_bias to dst[p] + dst_bias.
extern "C" __global__ void kvxfer_copy_pieces(
    const long long* __restrict__ src, const long long* __restrict__ dst,
    const long long* __restrict__ len, long long n, long long src_bias, long long dst_bias)
{
    for (long long p = blockIdx.x; p < n; p += gridDim.x)
        copy_bytes((const unsigned char*)(src[p] + src_bias), (unsigned char*)(dst[p] + dst_bias), len[p]);
}

// Whole blocks, addresses computed here from a small table (nothing per segment on the host):
// t = [src region base | dst region base | src stride | dst stride | segment bytes] (nreg each),
//     then the source and destination block ids (nblk each).
// blockIdx.x: segment (region-major), blockIdx.y: piece of ``piece`` bytes inside it.
extern "C" __global__ void kvxfer_copy_blocks(
    const long long* __restrict__ t, long long nreg, long long nblk, long long piece)
{
    long long g = blockIdx.x;
    long long r = g / nblk, j = g - r * nblk;
    long long off = (long long)blockIdx.y * piece;
    long long L = t[4 * nreg + r] - off;
    if (L <= 0) return;
    if (L > piece) L = piece;
    const unsigned char* s = (const unsigned char*)(t[r] + t[5 * nreg + j] * t[2 * nreg + r] + off);
    unsigned char* d = (unsigned char*)(t[nreg + r] + t[5 * nreg + nblk + j] * t[3 * nreg + r] + off);
    copy_bytes(s, d, L);
}
"""


def cut(start: I64, length: I64, step: int) -> tuple[I64, I64, I64]:
    """Cut ranges ``[start, start + length)`` at multiples of ``step``.

    Returns, per piece, the index of the range it came from, its start and its length.
    """
    start = np.asarray(start, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    first = start // step
    last = (start + length - 1) // step
    count = last - first + 1
    owner = np.repeat(np.arange(len(start), dtype=np.int64), count)
    nth = np.arange(owner.size, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    k = first[owner] + nth
    p_start = np.maximum(start[owner], k * step)
    p_end = np.minimum(start[owner] + length[owner], (k + 1) * step)
    return owner, p_start, p_end - p_start


def segment_addresses(base: I64, regions: RegionTable, ids: npt.NDArray[np.integer]) -> tuple[I64, I64]:
    """Address and length of each segment of ``ids``, in stream order (region-major).

    ``base`` holds each buffer's device address; ``ids`` are validated block ids.
    """
    ids = np.asarray(ids, dtype=np.int64)
    addr = (base[regions.buffer][:, None] + regions.offset[:, None] + ids[None, :] * regions.stride[:, None]).ravel()
    return addr, np.repeat(regions.nbytes, len(ids))


@dataclass
class PieceTable:
    """Pieces of one handoff side on the GPU: rows ``a`` and ``b`` are addresses (or stream
    positions), ``length`` their sizes; ``chunk_first[c]`` is chunk *c*'s first piece."""

    device_table: Any  # cupy int64 array (3, n)
    count: int
    chunk_first: I64
    nbytes: int

    @classmethod
    def local(cls, src: tuple[I64, I64], dst: tuple[I64, I64], max_piece: int = MAX_PIECE) -> tuple[I64, I64, I64]:
        """Host-side pieces of a pool → pool copy (both sides list the same segment sizes)."""
        (src_addr, lens), (dst_addr, dst_lens) = src, dst
        if not np.array_equal(lens, dst_lens):
            raise ValueError("source and destination segments differ in size")
        owner, rel, plen = cut(np.zeros_like(lens), lens, max_piece)
        return src_addr[owner] + rel, dst_addr[owner] + rel, plen

    @classmethod
    def stream(cls, seg: tuple[I64, I64], chunk_bytes: int, max_piece: int = MAX_PIECE) -> tuple[I64, I64, I64, I64]:
        """Host-side pieces of one side of a chunked stream: (pool address, stream position,
        length, first piece of each chunk). No piece crosses a chunk boundary."""
        addr, lens = seg
        seg_start = np.cumsum(lens) - lens
        owner, s1, l1 = cut(seg_start, lens, chunk_bytes)
        a1 = addr[owner] + (s1 - seg_start[owner])
        owner2, rel, plen = cut(np.zeros_like(l1), l1, max_piece)
        pos = s1[owner2] + rel
        total = int(lens.sum())
        nchunks = -(-total // chunk_bytes)
        first = np.searchsorted(pos, np.arange(nchunks + 1, dtype=np.int64) * chunk_bytes).astype(np.int64)
        return a1[owner2] + rel, pos, plen, first


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the copy kernel (the defaults were the fastest on an H100, see the
    README's GPU benchmark section; ``python -m bench.gpu`` sweeps the alternatives)."""

    threads: int = THREADS
    unroll: int = 4
    streaming: bool = False
    #: 0: one CUDA block per piece; k: k blocks per SM, each looping over pieces.
    blocks_per_sm: int = 0


class GpuCopier:
    """Launches :data:`KERNEL_SOURCE` on one device, on the daemon's own stream."""

    def __init__(self, device: int, config: KernelConfig = KernelConfig()) -> None:
        import cupy

        self._cp = cupy
        self.device = device
        self.config = config
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
            options = (f"-DUNROLL={config.unroll}", f"-DSTREAMING={int(config.streaming)}")
            module = cupy.RawModule(code=KERNEL_SOURCE, options=options)
            self._kernel = module.get_function("kvxfer_copy_pieces")
            self._blocks_kernel = module.get_function("kvxfer_copy_blocks")
            self._sms = int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])

    def upload(self, *rows: I64, chunk_first: I64 | None = None) -> PieceTable:
        """Put the piece rows on this device (one host-to-device copy)."""
        host = np.ascontiguousarray(np.stack(rows).astype(np.int64, copy=False))
        with self._cp.cuda.Device(self.device), self.stream:
            # On the copier's own stream: the kernel that reads the table is ordered after the
            # copy (a non-blocking stream does not wait for work on the default stream).
            table = self._cp.asarray(host)
        first = chunk_first if chunk_first is not None else np.array([0, host.shape[1]], dtype=np.int64)
        return PieceTable(table, host.shape[1], first, int(host[2].sum()) if host.shape[1] else 0)

    def launch(
        self,
        table: PieceTable,
        src_row: int,
        dst_row: int,
        first: int = 0,
        last: int | None = None,
        src_bias: int = 0,
        dst_bias: int = 0,
    ) -> Any:
        """Copy pieces ``first..last`` from row ``src_row`` to row ``dst_row`` (plus biases);
        returns the CUDA event that completes with the copy."""
        cp = self._cp
        last = table.count if last is None else last
        n = last - first
        with cp.cuda.Device(self.device):
            event = cp.cuda.Event(block=False, disable_timing=True)
            if n > 0:
                t = table.device_table
                cfg = self.config
                grid = min(n, MAX_GRID if cfg.blocks_per_sm == 0 else cfg.blocks_per_sm * self._sms)
                self._kernel(
                    (grid,),
                    (cfg.threads,),
                    (
                        t[src_row, first:],
                        t[dst_row, first:],
                        t[2, first:],
                        np.int64(n),
                        np.int64(src_bias),
                        np.int64(dst_bias),
                    ),
                    stream=self.stream,
                )
            event.record(self.stream)
        return event

    def launch_blocks(self, table: I64, nreg: int, nblk: int, max_segment: int, piece: int) -> Any:
        """Upload ``table`` (see ``kvxfer_copy_blocks``) and launch over every segment."""
        cp = self._cp
        with cp.cuda.Device(self.device), self.stream:
            # Allocated and copied on this stream, so ordered before the launch; CuPy's pool
            # reuses the memory only for later work on the same stream once ``t`` is dropped.
            t = cp.asarray(np.ascontiguousarray(table, dtype=np.int64))
            event = cp.cuda.Event(block=False, disable_timing=True)
            piece = max(piece, -(-max_segment // 65535))  # gridDim.y is at most 65535
            pieces_per_segment = -(-max_segment // piece)
            self._blocks_kernel(
                (nreg * nblk, pieces_per_segment),
                (self.config.threads,),
                (t, np.int64(nreg), np.int64(nblk), np.int64(piece)),
                stream=self.stream,
            )
            event.record(self.stream)
        return event


@dataclass(frozen=True)
class BlockSide:
    """One side of a block copy: each region's first-byte address (buffer address + region
    offset), its block stride and segment size, and the block ids in handoff order."""

    device: int
    region_base: I64
    stride: I64
    nbytes: I64
    ids: I64

    @classmethod
    def of(cls, device: int, buffer_base: I64, regions: RegionTable, ids: npt.NDArray[np.integer]) -> BlockSide:
        return cls(
            device,
            buffer_base[regions.buffer] + regions.offset,
            regions.stride,
            regions.nbytes,
            np.asarray(ids, dtype=np.int64),
        )

    def segments(self) -> tuple[I64, I64]:
        """Segment addresses and lengths in stream order (for the chunked paths)."""
        addr = (self.region_base[:, None] + self.ids[None, :] * self.stride[:, None]).ravel()
        return addr, np.repeat(self.nbytes, len(self.ids))


def launch_blocks(copier: GpuCopier, src: BlockSide, dst: BlockSide, piece: int = MAX_PIECE) -> Any:
    """One launch of ``kvxfer_copy_blocks`` copying every block of ``src`` to ``dst``; the host
    work is O(regions + blocks), never per segment. Returns the completion event."""
    if not np.array_equal(src.nbytes, dst.nbytes) or len(src.ids) != len(dst.ids):
        raise ValueError("source and destination differ in segment sizes or block count")
    table = np.concatenate([src.region_base, dst.region_base, src.stride, dst.stride, src.nbytes, src.ids, dst.ids])
    return copier.launch_blocks(table, len(src.nbytes), len(src.ids), int(src.nbytes.max()), piece)


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
        self._buffer_bytes = buffer_bytes
        self._copiers: dict[int, GpuCopier] = {}
        self._staging: dict[tuple[int, str], StagingPool] = {}
        self._peer: dict[tuple[int, int], bool] = {}

    def copier(self, device: int) -> GpuCopier:
        copier = self._copiers.get(device)
        if copier is None:
            copier = self._copiers[device] = GpuCopier(device)
        return copier

    def staging(self, device: int, direction: str) -> StagingPool:
        """Registered-by-UCX-on-first-use GPU staging for ``direction`` ("send"/"receive")."""
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

            pool = self._staging[(device, direction)] = StagingPool(self._staging_bytes, self._buffer_bytes, allocate)
        return pool

    def in_use(self) -> int:
        return sum(p.in_use for p in self._staging.values())

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

    async def copy_local(self, src: BlockSide, dst: BlockSide, staged_bytes: int) -> str:
        """Copy one handoff between two mapped pools; returns the transport used.

        A host pool has been pinned and its side names the GPU of the other. Same GPU or peer
        access: one launch of the block kernel on the destination's GPU. Otherwise chunks of
        ``staged_bytes`` go gather → device-to-device copy → scatter.
        """
        if self.peer_ok(dst.device, src.device):
            await settle(launch_blocks(self.copier(dst.device), src, dst))
            return "local-kernel" if src.device == dst.device else "local-kernel:p2p"
        await self._copy_staged(src.device, src.segments(), dst.device, dst.segments(), staged_bytes)
        return "local-kernel:staged"

    async def _copy_staged(
        self, src_dev: int, src: tuple[I64, I64], dst_dev: int, dst: tuple[I64, I64], chunk: int
    ) -> None:
        cp = self._cp
        sa, spos, slen, first = PieceTable.stream(src, chunk)
        da, dpos, dlen, dfirst = PieceTable.stream(dst, chunk)
        gather, scatter = self.copier(src_dev), self.copier(dst_dev)
        st, dt = gather.upload(sa, spos, slen, chunk_first=first), scatter.upload(da, dpos, dlen, chunk_first=dfirst)
        total = int(slen.sum())
        async with self.staging(src_dev, "send").lease(1) as out, self.staging(dst_dev, "receive").lease(1) as into:
            sbuf, dbuf = out.buffers[0], into.buffers[0]
            for c in range(len(first) - 1):
                nbytes = min(chunk, total - c * chunk)
                await settle(
                    gather.launch(st, 0, 1, int(first[c]), int(first[c + 1]), dst_bias=sbuf.data.ptr - c * chunk)
                )
                with cp.cuda.Device(dst_dev):
                    cp.cuda.runtime.memcpyPeerAsync(
                        dbuf.data.ptr, dst_dev, sbuf.data.ptr, src_dev, nbytes, scatter.stream.ptr
                    )
                ev = scatter.launch(dt, 1, 0, int(dfirst[c]), int(dfirst[c + 1]), src_bias=dbuf.data.ptr - c * chunk)
                await settle(ev)
