"""Segment plans and host copies: every byte lands where (region, block id) says."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.dataplane.cma import copy_iov, self_copy_works
from kvxferd.dataplane.hostcopy import chunk_iov, copy_chunk, gather_chunk, scatter_chunk
from kvxferd.dataplane.plan import RegionTable, _plan_general, _plan_small, _plan_whole, build_plan


def reference_copy(regions, src, dst, src_ids, dst_ids):  # type: ignore[no-untyped-def]
    """The obvious per-segment loop, as the specification of a handoff."""
    for buf, off, stride, length in regions:
        for s, d in zip(src_ids, dst_ids, strict=True):
            dst[buf][off + d * stride : off + d * stride + length] = src[buf][
                off + s * stride : off + s * stride + length
            ]


@st.composite
def handoffs(draw: st.DrawFn) -> tuple:  # type: ignore[type-arg]
    num_blocks = draw(st.integers(1, 24))
    nbuf = draw(st.integers(1, 3))
    sizes = [0] * nbuf
    regions = []
    for _ in range(draw(st.integers(1, 5))):
        length = draw(st.integers(1, 40))
        stride = length + draw(st.sampled_from([0, 0, 1, 7, length]))
        buf = draw(st.integers(0, nbuf - 1))
        off = sizes[buf] + draw(st.integers(0, 5))
        regions.append((buf, off, stride, length))
        sizes[buf] = off + (num_blocks - 1) * stride + length
    n = draw(st.integers(1, num_blocks))
    src_ids = draw(st.permutations(range(num_blocks)))[:n]
    dst_ids = draw(st.permutations(range(num_blocks)))[:n]
    if draw(st.booleans()):
        src_ids = sorted(src_ids)
    chunk = draw(st.integers(1, 300))
    return regions, sizes, src_ids, dst_ids, chunk


@settings(max_examples=300, deadline=None)
@given(handoffs(), st.booleans())
def test_gather_scatter_through_chunks_equals_the_per_segment_copy(case: tuple, direct: bool) -> None:  # type: ignore[type-arg]
    _check_chunked_copy(case, "copy_chunk" if direct else "gather+scatter")


@pytest.mark.skipif(not self_copy_works(), reason="process_vm_readv on this process is refused here")
@settings(max_examples=300, deadline=None)
@given(handoffs())
def test_single_pass_kernel_copy_equals_the_per_segment_copy(case: tuple) -> None:  # type: ignore[type-arg]
    _check_chunked_copy(case, "single-pass")


def _check_chunked_copy(case: tuple, how: str) -> None:  # type: ignore[type-arg]
    regions, sizes, src_ids, dst_ids, chunk = case
    rng = np.random.default_rng(len(src_ids))
    src = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]
    dst = [np.zeros(s, np.uint8) for s in sizes]
    expected = [np.zeros(s, np.uint8) for s in sizes]
    reference_copy(regions, src, expected, src_ids, dst_ids)

    table = RegionTable.from_regions(regions)
    sp, dp = build_plan(table, np.array(src_ids), chunk), build_plan(table, np.array(dst_ids), chunk)
    assert sp.total_bytes == dp.total_bytes == len(src_ids) * sum(r[3] for r in regions)
    assert [c.nbytes for c in sp.chunks] == [c.nbytes for c in dp.chunks]
    scratch = np.empty(chunk, np.uint8)
    for a, b in zip(sp.chunks, dp.chunks, strict=True):
        if how == "single-pass" and a.contiguous is None and b.contiguous is None:
            copy_iov(chunk_iov(dst, b), chunk_iov(src, a))  # what copy_chunk does for large pieces
        elif how == "single-pass":
            copy_chunk(src, a, dst, b, scratch, single_pass=True)
        elif how == "copy_chunk":
            copy_chunk(src, a, dst, b, scratch)
        else:
            gather_chunk(src, a, scratch)
            scatter_chunk(dst, b, scratch)
    for e, d in zip(expected, dst, strict=True):
        np.testing.assert_array_equal(e, d)


def test_plan_work_does_not_grow_with_blocks() -> None:
    """8192 segments of a Llama-3-8B request become a few dozen runs, not 8192 operations."""
    regions = [(layer, kv * 512 * 32768, 32768, 32768) for layer in range(32) for kv in range(2)]
    ids = np.random.default_rng(0).permutation(512)[:128]
    plan = build_plan(RegionTable.from_regions(regions), ids, 4 << 20)
    runs = sum(len(c.runs) for c in plan.chunks)
    assert plan.num_segments == 8192
    assert len(plan.chunks) == 64
    assert runs <= len(plan.chunks) + len(regions)


def test_contiguous_chunks_are_marked_for_zero_copy() -> None:
    plan = build_plan(RegionTable.from_regions([(0, 0, 1 << 20, 1 << 20)]), np.array([2, 3, 4, 5]), 1 << 20)
    assert [c.contiguous for c in plan.chunks] == [(0, 2 << 20), (0, 3 << 20), (0, 4 << 20), (0, 5 << 20)]


def test_chunks_that_end_on_segment_boundaries_plan_the_same_pieces_as_cut_ones() -> None:
    """Chunks a multiple of the segment size take the planner's short path; the pieces must be
    those a cut at the same place would give: every segment, in stream order, in its chunk."""
    regions = [(0, 0, 96, 32), (0, 32, 96, 32), (1, 8, 40, 32)]
    ids = [5, 0, 3, 7, 1]
    plan = build_plan(RegionTable.from_regions(regions), np.array(ids), 64)  # two segments a chunk
    pieces = [
        (run.buffer, int(off), run.length, chunk.index, run.chunk_offset + k * run.length)
        for chunk in plan.chunks
        for run in chunk.runs
        for k, off in enumerate(run.offsets)
    ]
    segments = [(buf, off + i * stride, length) for buf, off, stride, length in regions for i in ids]
    assert pieces == [(*seg, n // 2, n % 2 * 32) for n, seg in enumerate(segments)]
    assert [c.nbytes for c in plan.chunks] == [64] * 7 + [32]


def test_whole_segment_plans_match_the_general_arithmetic() -> None:
    """plan_segments' shortcut for segments that never cross a chunk boundary gives the general
    path's plan, and steps aside when one does cross."""
    rng = np.random.default_rng(3)
    shortcuts = 0
    for _ in range(300):
        n = int(rng.integers(1, 400))
        unit = int(rng.choice([4, 8, 16]))
        lengths = unit * np.where(rng.random(n) < 0.9, 1, rng.integers(2, 4, n))
        buf = np.sort(rng.integers(0, 3, n))
        # Adjacent pieces interrupted by jumps: contiguous and scattered chunks both occur.
        gaps = np.where(rng.random(n) < 0.7, 0, unit * rng.integers(1, 9, n))
        off = np.cumsum(lengths + gaps) - (lengths[0] + gaps[0])
        chunk = unit * int(rng.integers(1, 40))
        fast, ref = _plan_whole(buf, off, lengths, chunk), _plan_general(buf, off, lengths, chunk)
        if fast is None:
            ends = np.cumsum(lengths)
            assert ((ends - lengths) // chunk != (ends - 1) // chunk).any()  # one does cross
            continue
        shortcuts += 1
        assert (fast.total_bytes, fast.num_segments) == (ref.total_bytes, ref.num_segments)
        for mine, theirs in zip(fast.chunks, ref.chunks, strict=True):
            assert (mine.index, mine.nbytes, mine.contiguous) == (theirs.index, theirs.nbytes, theirs.contiguous)
            assert [(r.buffer, r.length, r.chunk_offset, r.offsets.tolist()) for r in mine.runs] == [
                (r.buffer, r.length, r.chunk_offset, r.offsets.tolist()) for r in theirs.runs
            ]
    assert shortcuts > 50


def test_small_plans_match_the_general_arithmetic() -> None:
    """plan_segments' pure-Python path for a few segments gives the general path's plan,
    segments crossing chunk boundaries included."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(1, 65))
        lengths = rng.integers(1, 40, n)
        buf = np.sort(rng.integers(0, 3, n))
        gaps = np.where(rng.random(n) < 0.6, 0, rng.integers(1, 50, n))
        off = np.cumsum(lengths + gaps) - (lengths[0] + gaps[0])
        chunk = int(rng.integers(1, 120))
        mine, ref = _plan_small(buf, off, lengths, chunk), _plan_general(buf, off, lengths, chunk)
        assert (mine.total_bytes, mine.num_segments) == (ref.total_bytes, ref.num_segments)
        for a, b in zip(mine.chunks, ref.chunks, strict=True):
            assert (a.index, a.nbytes, a.contiguous) == (b.index, b.nbytes, b.contiguous)
            assert [(r.buffer, r.length, r.chunk_offset, r.offsets.tolist()) for r in a.runs] == [
                (r.buffer, r.length, r.chunk_offset, r.offsets.tolist()) for r in b.runs
            ]
