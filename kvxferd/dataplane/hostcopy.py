"""Vectorised copies between host buffers and packed chunks.

A :class:`~kvxferd.dataplane.plan.Run` is ``k`` pieces of ``L`` bytes at arbitrary byte
offsets. Viewing the buffer as overlapping ``L``-byte items at a 1-byte stride turns the run
into one numpy fancy-index copy (a C loop of memcpys, GIL released), whatever ``k`` is.
A chunk is also an ``(address, length)`` list (:func:`chunk_iov`), the form UCX's IOV
operations and the kernel's scatter-gather copy (:mod:`.cma`) take.

The kernel's copy pins the pages of every entry, so it pays per piece: below a page per piece
numpy's two passes win. Measured here in one run (``python -m bench.sliced``, 128 MiB local
handoffs): 16 KiB segments 6.1 GB/s in one pass against 3.8 through numpy; 256-byte pieces
(a head-order conversion) 1.5 GB/s in one pass against 4.5 through numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from .cma import copy_iov
from .plan import ChunkPlan, RegionTable

__all__ = [
    "FEW_SEGMENTS",
    "SINGLE_PASS_MIN_PIECE",
    "chunk_iov",
    "contiguous_iov",
    "copy_chunk",
    "copy_few_blocks",
    "gather_chunk",
    "iov_at",
    "scatter_chunk",
    "scatter_few_blocks",
    "small_pieces",
]

U8 = npt.NDArray[np.uint8]

#: The mean piece size from which a chunk goes through the kernel's one-pass copy: a page.
SINGLE_PASS_MIN_PIECE = 4096


#: Up to this many segments (regions x blocks), a host copy between two pools mapped here is
#: one slice assignment per segment: planning the stream in chunks costs more than the copy
#: (a one-block local handoff spent ~0.3 ms of its 1 ms pull planning and copying 4 KiB).
FEW_SEGMENTS = 16


def copy_few_blocks(
    src_buffers: Sequence[U8],
    src: RegionTable,
    src_ids: Sequence[int],
    dst_buffers: Sequence[U8],
    dst: RegionTable,
    dst_ids: Sequence[int],
) -> int:
    """Copy a few blocks region by region between two layouts of the same segment sizes (one
    fingerprint), one slice assignment per segment, at most :data:`FEW_SEGMENTS` of them;
    returns the bytes copied.

    >>> a, b = np.arange(32, dtype=np.uint8), np.zeros(32, dtype=np.uint8)
    >>> regions = RegionTable.from_regions([(0, 0, 8, 4), (0, 4, 8, 4)])  # K, V: 4 bytes each
    >>> copy_few_blocks([a], regions, [3], [b], regions, [1])
    8
    >>> b[8:16].tolist() == a[24:32].tolist()
    True
    """
    if len(src.lists[3]) * len(src_ids) > FEW_SEGMENTS:
        raise ValueError(f"more than {FEW_SEGMENTS} segments: plan the copy in chunks")
    (s_buf, s_off, s_stride, s_len), (d_buf, d_off, d_stride, _) = src.lists, dst.lists
    copied = 0
    for r, n in enumerate(s_len):
        into, out_of = dst_buffers[d_buf[r]], src_buffers[s_buf[r]]
        for i, j in zip(src_ids, dst_ids, strict=True):
            a, b = s_off[r] + i * s_stride[r], d_off[r] + j * d_stride[r]
            into[b : b + n] = out_of[a : a + n]
        copied += n * len(src_ids)
    return copied


def scatter_few_blocks(dst_buffers: Sequence[U8], dst: RegionTable, dst_ids: Sequence[int], data: U8) -> None:
    """Lay ``data``, a few blocks' segments back to back in stream order (region-major), into
    ``dst_ids``: one slice assignment per segment, at most :data:`FEW_SEGMENTS`.

    >>> b = np.zeros(32, dtype=np.uint8)
    >>> regions = RegionTable.from_regions([(0, 0, 8, 4), (0, 4, 8, 4)])
    >>> scatter_few_blocks([b], regions, [2], np.arange(1, 9, dtype=np.uint8))
    >>> b[16:24].tolist()
    [1, 2, 3, 4, 5, 6, 7, 8]
    """
    buffer, offset, stride, nbytes = dst.lists
    if len(nbytes) * len(dst_ids) > FEW_SEGMENTS or data.nbytes != sum(nbytes) * len(dst_ids):
        raise ValueError("not a few blocks' segments of this layout")
    at = 0
    for r, n in enumerate(nbytes):
        into = dst_buffers[buffer[r]]
        for j in dst_ids:
            b = offset[r] + j * stride[r]
            into[b : b + n] = data[at : at + n]
            at += n


def small_pieces(chunk: ChunkPlan) -> bool:
    """Whether ``chunk``'s pieces average less than :data:`SINGLE_PASS_MIN_PIECE` bytes.

    >>> from .plan import RegionTable, build_plan
    >>> plan = build_plan(RegionTable.from_regions([(0, 0, 8192, 256)]), np.array([2, 0]), 512)
    >>> small_pieces(plan.chunks[0])
    True
    """
    if chunk.contiguous is not None:
        return False
    return chunk.nbytes < SINGLE_PASS_MIN_PIECE * sum(len(run.offsets) for run in chunk.runs)


def _items(buf: U8, length: int) -> npt.NDArray[np.void]:
    """``buf`` as overlapping items of ``length`` bytes, item *i* starting at byte *i*."""
    return np.ndarray(shape=(buf.nbytes - length + 1,), dtype=np.dtype((np.void, length)), buffer=buf, strides=(1,))


def _rows(buf: U8, offsets: npt.NDArray[np.int64], length: int) -> tuple[U8, npt.NDArray[np.int64]] | None:
    """When every offset is ``base + k * length``, the run as rows of a contiguous 2-D view."""
    base = int(offsets.min())
    rel = offsets - base
    if (rel % length).any():
        return None
    rows = rel // length
    return buf[base : base + (int(rows.max()) + 1) * length].reshape(-1, length), rows


def chunk_iov(arrays: Sequence[U8], chunk: ChunkPlan) -> npt.NDArray[np.uint64]:
    """The chunk's pieces as ``(address, length)`` rows (``ucp_dt_iov_t``, ``struct iovec``),
    in stream order."""
    used = {chunk.contiguous[0]} if chunk.contiguous is not None else {run.buffer for run in chunk.runs}
    return iov_at({i: int(arrays[i].ctypes.data) for i in used}, chunk)


def iov_at(base: Sequence[int] | Mapping[int, int] | npt.NDArray[np.int64], chunk: ChunkPlan) -> npt.NDArray[np.uint64]:
    """The chunk's pieces as ``(address, length)`` rows, with buffer *i* at ``base[i]`` (in
    this process, or in the engine's process the rows are meant for)."""
    if chunk.contiguous is not None:
        buf, off = chunk.contiguous
        return np.array([[int(base[buf]) + off, chunk.nbytes]], dtype=np.uint64)
    if sum(len(run.offsets) for run in chunk.runs) <= FEW_SEGMENTS:  # rows listed: one numpy call
        rows = [(int(base[run.buffer]) + off, run.length) for run in chunk.runs for off in run.offsets.tolist()]
        return np.array(rows, dtype=np.uint64)
    parts = []
    for run in chunk.runs:
        entries = np.empty((len(run.offsets), 2), dtype=np.uint64)
        entries[:, 0] = int(base[run.buffer]) + run.offsets
        entries[:, 1] = run.length
        parts.append(entries)
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def contiguous_iov(buf: U8) -> npt.NDArray[np.uint64]:
    """One ``(address, length)`` row covering ``buf``."""
    return np.array([[buf.ctypes.data, buf.nbytes]], dtype=np.uint64)


def chunk_view(buffers: Sequence[U8], chunk: ChunkPlan) -> U8:
    """The memory of a contiguous chunk, in place."""
    assert chunk.contiguous is not None
    buf, off = chunk.contiguous
    return buffers[buf][off : off + chunk.nbytes]


def gather_chunk(buffers: Sequence[U8], chunk: ChunkPlan, out: U8) -> None:
    """Pack ``chunk``'s pieces from ``buffers`` into ``out[:chunk.nbytes]``."""
    if chunk.contiguous is not None:
        out[: chunk.nbytes] = chunk_view(buffers, chunk)
        return
    for run in chunk.runs:
        dst = out[run.chunk_offset : run.chunk_offset + run.nbytes]
        if len(run.offsets) == 1:
            o = int(run.offsets[0])
            dst[:] = buffers[run.buffer][o : o + run.length]
            continue
        rows = _rows(buffers[run.buffer], run.offsets, run.length)
        if rows is not None:
            # take() into ``out`` with mode="clip" writes in place (mode="raise" goes through a
            # temporary): 9.4 GB/s against 6.5 GB/s for fancy indexing, measured here.
            np.take(rows[0], rows[1], axis=0, out=dst.reshape(-1, run.length), mode="clip")
        else:
            dst.view(np.dtype((np.void, run.length)))[:] = _items(buffers[run.buffer], run.length)[run.offsets]


def scatter_chunk(buffers: Sequence[U8], chunk: ChunkPlan, src: U8) -> None:
    """Unpack ``src[:chunk.nbytes]`` into ``chunk``'s pieces of ``buffers``."""
    if chunk.contiguous is not None:
        chunk_view(buffers, chunk)[:] = src[: chunk.nbytes]
        return
    for run in chunk.runs:
        piece = src[run.chunk_offset : run.chunk_offset + run.nbytes]
        if len(run.offsets) == 1:
            o = int(run.offsets[0])
            buffers[run.buffer][o : o + run.length] = piece
        else:
            _items(buffers[run.buffer], run.length)[run.offsets] = piece.view(np.dtype((np.void, run.length)))


def copy_chunk(
    src_buffers: Sequence[U8],
    src: ChunkPlan,
    dst_buffers: Sequence[U8],
    dst: ChunkPlan,
    scratch: U8 | None,
    single_pass: bool = False,
) -> None:
    """Copy one chunk between two plans of the same stream. When neither side is contiguous,
    the kernel copies segment to segment when ``single_pass`` (see :mod:`.cma`; the caller
    checked :func:`.cma.self_copy_works`) and neither side has :func:`small_pieces`, else
    numpy goes through ``scratch``."""
    if src.contiguous is not None:
        scatter_chunk(dst_buffers, dst, chunk_view(src_buffers, src))
    elif dst.contiguous is not None:
        gather_chunk(src_buffers, src, chunk_view(dst_buffers, dst))
    elif single_pass and not (small_pieces(src) or small_pieces(dst)):
        copy_iov(chunk_iov(dst_buffers, dst), chunk_iov(src_buffers, src))
    else:
        assert scratch is not None, "a two-pass copy needs scratch"
        gather_chunk(src_buffers, src, scratch)
        scatter_chunk(dst_buffers, dst, scratch)
