"""The GPU kernels' index math moves exactly the bytes of a handoff (checked on the CPU).

``emulate_blocks`` and ``emulate_stream`` run the grid of ``kvxfer_copy_blocks`` and
``kvxfer_copy_stream`` block by block with numpy, over one "memory" array whose offsets stand
in for addresses, using the same host-side helpers as the daemon (tables, grid shape, chunk
→ segment range). The results are compared with the host data plane's copies. The kernels
themselves run in ``tests/integration/test_gpu.py`` on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.cuda import describe_cuda_tensor, format_uuid, is_cuda_tensor
from kvxfer.errors import InvalidRequestError
from kvxferd.dataplane.gpu_kernel import BlockSide, piece_for
from kvxferd.dataplane.hostcopy import gather_chunk, scatter_chunk
from kvxferd.dataplane.plan import RegionTable, build_plan, stream_plan


def emulate_blocks(memory: np.ndarray, s: BlockSide, d: BlockSide, piece: int) -> None:
    piece, per_segment = piece_for(int(s.nbytes.max()), piece)
    nblk = len(s.ids)
    for g in range(len(s.nbytes) * nblk):  # blockIdx.x
        r, j = divmod(g, nblk)
        for y in range(per_segment):  # blockIdx.y
            off = y * piece
            n = min(piece, int(s.nbytes[r]) - off)
            if n <= 0:
                continue
            a = int(s.region_base[r] + s.ids[j] * s.stride[r]) + off
            b = int(d.region_base[r] + d.ids[j] * d.stride[r]) + off
            memory[b : b + n] = memory[a : a + n]


def emulate_stream(memory: np.ndarray, side: BlockSide, c: int, chunk: int, staging: int, to_staging: bool) -> None:
    lo, hi = c * chunk, min((c + 1) * chunk, side.total_bytes)
    g0, g1 = side.segments_overlapping(lo, hi)
    piece, per_segment = piece_for(int(side.nbytes.max()))
    nblk = len(side.ids)
    for g in range(g0, g1):
        r, j = divmod(g, nblk)
        seg = int(side.nbytes[r])
        start = int(side.stream_start[r]) + j * seg
        for y in range(per_segment):
            a = max(start + y * piece, lo)
            b = min(start + y * piece + piece, start + seg, hi)
            if a >= b:
                continue
            pool = int(side.region_base[r] + side.ids[j] * side.stride[r]) + (a - start)
            stage = staging + (a - lo)
            if to_staging:
                memory[stage : stage + b - a] = memory[pool : pool + b - a]
            else:
                memory[pool : pool + b - a] = memory[stage : stage + b - a]


def two_region_pool(block_bytes: int, blocks: int, second: int) -> RegionTable:
    """Region 0: ``block_bytes`` per block; region 1 (after it in the same buffer): ``second``."""
    return RegionTable.from_regions([(0, 0, block_bytes, block_bytes), (0, blocks * block_bytes + 5, second, second)])


@pytest.mark.parametrize("block_bytes", [3, 1000, 32 << 10, 100_000])
def test_the_block_kernel_copies_every_block_exactly_whatever_the_segment_size(block_bytes: int) -> None:
    blocks = 12
    regions = two_region_pool(block_bytes, blocks, 48)
    pool_bytes = blocks * block_bytes + 5 + blocks * 48
    memory = np.random.default_rng(1).integers(0, 256, 2 * pool_bytes, dtype=np.uint8)
    src_ids, dst_ids = np.array([5, 2, 11, 7]), np.array([0, 9, 3, 4])
    src = BlockSide.of(0, np.array([0]), regions, src_ids)
    dst = BlockSide.of(0, np.array([pool_bytes]), regions, dst_ids)
    expected = memory.copy()
    for (sa, n), (da, _) in zip(zip(*src.segments(), strict=True), zip(*dst.segments(), strict=True), strict=True):
        expected[da : da + n] = expected[sa : sa + n]
    emulate_blocks(memory, src, dst, piece=16 << 10)
    assert np.array_equal(memory, expected)


@pytest.mark.parametrize(
    ("chunk", "block_bytes"), [(100_000, 24 << 10), (65536, 3000), (1 << 20, 8192), (4096, 70_000)]
)
def test_stream_chunks_gather_and_scatter_like_the_host_plan(chunk: int, block_bytes: int) -> None:
    blocks = 40
    regions = two_region_pool(block_bytes, blocks, 1000)
    pool_bytes = blocks * block_bytes + 5 + blocks * 1000
    memory = np.random.default_rng(2).integers(0, 256, 2 * pool_bytes + chunk, dtype=np.uint8)
    ids = np.array([9, 3, 39, 1, 2, 33, 20])
    side = BlockSide.of(0, np.array([0]), regions, ids)
    plan = build_plan(regions, ids, chunk)
    assert [(c.index, c.nbytes) for c in stream_plan(side.total_bytes, chunk).chunks] == [
        (c.index, c.nbytes) for c in plan.chunks
    ]
    staging = 2 * pool_bytes  # staging lives after the pools in the same "memory"
    pool = memory[:pool_bytes]
    for c in plan.chunks:
        emulate_stream(memory, side, c.index, chunk, staging, to_staging=True)
        expected = np.empty(chunk, dtype=np.uint8)
        gather_chunk([pool], c, expected)
        assert np.array_equal(memory[staging : staging + c.nbytes], expected[: c.nbytes]), c.index

    # Scatter: chunks of a random stream land where the host plan's scatter puts them.
    dst_ids = np.array([0, 4, 8, 12, 16, 20, 24])
    dst = BlockSide.of(0, np.array([pool_bytes]), regions, dst_ids)
    dst_plan = build_plan(regions, dst_ids, chunk)
    want = memory[pool_bytes : 2 * pool_bytes].copy()
    rng = np.random.default_rng(3)
    for c in dst_plan.chunks:
        data = rng.integers(0, 256, c.nbytes, dtype=np.uint8)
        memory[staging : staging + c.nbytes] = data
        emulate_stream(memory, dst, c.index, chunk, staging, to_staging=False)
        scatter_chunk([want], c, data)
    assert np.array_equal(memory[pool_bytes : 2 * pool_bytes], want)


def test_segments_overlapping_matches_a_brute_force_search() -> None:
    side = BlockSide(0, np.array([0, 0, 0]), np.array([1, 1, 1]), np.array([7, 3, 10]), np.arange(5))
    starts = np.concatenate([side.stream_start[r] + np.arange(5) * side.nbytes[r] for r in range(3)])
    ends = starts + np.repeat(side.nbytes, 5)
    for lo in range(side.total_bytes):
        for hi in range(lo + 1, side.total_bytes + 1):
            hit = np.flatnonzero((starts < hi) & (ends > lo))
            assert side.segments_overlapping(lo, hi) == (hit[0], hit[-1] + 1), (lo, hi)


def test_uuid_format_and_non_tensors_are_refused_clearly() -> None:
    assert format_uuid(bytes(16)) == "GPU-00000000-0000-0000-0000-000000000000"
    assert not is_cuda_tensor(np.zeros(4))
    with pytest.raises(InvalidRequestError, match="not a GPU tensor"):
        describe_cuda_tensor(np.zeros(4))
