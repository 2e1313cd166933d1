"""What the GPU copy kernels compute: the CUDA source, each side's table of regions and block
ids (:class:`BlockSide`), and how segments are cut into pieces. No CuPy here: the launches are
in :mod:`.gpucopy`.

CUDA block ``(x, y)`` copies piece ``y`` (at most ``piece`` bytes) of segment ``x``, with
16-byte loads and stores when both ends share an alignment and a byte loop otherwise.

>>> import numpy as np
>>> side = BlockSide(0, np.array([1000, 5000]), np.array([64, 64]), np.array([16, 40]), np.array([3, 1, 2]))
>>> side.total_bytes, side.stream_start.tolist()
(168, [0, 48])
>>> side.segments_overlapping(40, 100)     # segment 2 (region 0) to segment 4 (region 1)
(2, 5)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .plan import RegionTable

__all__ = ["KERNEL_SOURCE", "MAX_PIECE", "BlockSide", "KernelConfig", "piece_for"]

I64 = npt.NDArray[np.int64]

#: Largest piece one CUDA block copies.
MAX_PIECE = 32 << 10
#: gridDim.y is at most 65535: pieces grow for segments beyond 65535 pieces.
_MAX_GRID_Y = 65535

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

// Table of one side (nreg entries each, then nblk block ids):
//   [region base | block stride | segment bytes | region's stream start] [ids]
#define BASE(t, r) t[r]
#define STRIDE(t, r) t[nreg + (r)]
#define SEGBYTES(t, r) t[2 * nreg + (r)]
#define STREAM0(t, r) t[3 * nreg + (r)]
#define ID(t, j) t[4 * nreg + (j)]

// Local path: block j of ``s`` to block j of ``d``, every region; x = segment, y = piece.
extern "C" __global__ void kvxfer_copy_blocks(
    const long long* __restrict__ s, const long long* __restrict__ d, long long nreg, long long nblk, long long piece)
{
    long long g = blockIdx.x;
    long long r = g / nblk, j = g - r * nblk;
    long long off = (long long)blockIdx.y * piece;
    long long L = SEGBYTES(s, r) - off;
    if (L <= 0) return;
    if (L > piece) L = piece;
    copy_bytes((const unsigned char*)(BASE(s, r) + ID(s, j) * STRIDE(s, r) + off),
               (unsigned char*)(BASE(d, r) + ID(d, j) * STRIDE(d, r) + off), L);
}

// One chunk [lo, hi) of a side's stream between the pool and ``staging`` (which holds the
// chunk from its first byte); x = segment - g0, y = piece of the segment.
extern "C" __global__ void kvxfer_copy_stream(
    const long long* __restrict__ t, long long nreg, long long nblk, long long piece, long long g0,
    long long lo, long long hi, long long staging, int to_staging)
{
    long long g = g0 + blockIdx.x;
    long long r = g / nblk, j = g - r * nblk;
    if (r >= nreg) return;
    long long seg = SEGBYTES(t, r);
    long long start = STREAM0(t, r) + j * seg;
    long long a = start + (long long)blockIdx.y * piece;
    long long b = a + piece;
    if (b > start + seg) b = start + seg;
    if (a < lo) a = lo;
    if (b > hi) b = hi;
    if (a >= b) return;
    unsigned char* pool = (unsigned char*)(BASE(t, r) + ID(t, j) * STRIDE(t, r) + (a - start));
    unsigned char* stage = (unsigned char*)(staging + (a - lo));
    if (to_staging) copy_bytes(pool, stage, b - a);
    else copy_bytes(stage, pool, b - a);
}
"""


@dataclass(frozen=True)
class BlockSide:
    """One side of a handoff on a GPU (or a pinned host pool): each region's first address
    (buffer address + region offset), block stride and segment size, and the block ids."""

    device: int
    region_base: I64
    stride: I64
    nbytes: I64
    ids: I64
    stream_start: I64 = field(init=False)
    total_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        sizes = self.nbytes * len(self.ids)
        object.__setattr__(self, "stream_start", np.cumsum(sizes) - sizes)
        object.__setattr__(self, "total_bytes", int(sizes.sum()))

    @classmethod
    def of(cls, device: int, buffer_base: I64, regions: RegionTable, ids: npt.NDArray[np.integer]) -> BlockSide:
        return cls(
            device,
            buffer_base[regions.buffer] + regions.offset,
            regions.stride.copy(),
            regions.nbytes.copy(),
            np.asarray(ids, dtype=np.int64),
        )

    def table(self) -> I64:
        """The kernels' table of this side (see ``KERNEL_SOURCE``)."""
        return np.concatenate([self.region_base, self.stride, self.nbytes, self.stream_start, self.ids])

    def segments_overlapping(self, lo: int, hi: int) -> tuple[int, int]:
        """Segments ``g0 .. g1 - 1`` (region-major numbering) that hold stream bytes ``lo .. hi - 1``."""
        n = len(self.ids)
        ends = self.stream_start + self.nbytes * n

        def segment_at(pos: int) -> int:
            r = int(np.searchsorted(ends, pos, side="right"))
            return r * n + (pos - int(self.stream_start[r])) // int(self.nbytes[r])

        return segment_at(lo), segment_at(hi - 1) + 1

    def segments(self) -> tuple[I64, I64]:
        """Segment addresses and lengths in stream order (tests and diagnostics)."""
        addr = (self.region_base[:, None] + self.ids[None, :] * self.stride[:, None]).ravel()
        return addr, np.repeat(self.nbytes, len(self.ids))


def piece_for(max_segment: int, piece: int = MAX_PIECE) -> tuple[int, int]:
    """``(piece, pieces per segment)`` for segments of up to ``max_segment`` bytes."""
    piece = max(piece, -(-max_segment // _MAX_GRID_Y))
    return piece, max(1, -(-max_segment // piece))


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the copy kernels (``python -m bench.gpu --sweep-kernel`` times the
    alternatives; the defaults were among the fastest on an H100)."""

    threads: int = 512
    unroll: int = 4
    streaming: bool = False
