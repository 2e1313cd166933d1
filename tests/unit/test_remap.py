"""The remap planner against a numpy reference, element by element.

A model's KV is one logical array ``[layers, K/V, tokens, heads, head_bytes]``. Each pool holds
its tensor-parallel rank's heads in per-layer tensors ``[2, num_blocks, ...]`` whose blocks are
heads-major (``[heads, block_tokens, head_bytes]``) or tokens-major (``[block_tokens, heads,
head_bytes]``). The source pools are filled from the logical array; the planned segments move
the bytes chunk by chunk (gather on one side, scatter on the other, as the data plane does);
the destination must then equal what the logical array says, and every byte the transfer does
not own must still be zero.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.heads import HEAD_BYTES, LAYERS, POOL_BLOCKS, Pool, logical_kv
from kvxfer.errors import IncompatibleError, InvalidRequestError
from kvxfer.geometry import HeadRange, head_sources, rank_heads, readers
from kvxferd.dataplane.checksum import window_sums
from kvxferd.dataplane.hostmem import MappedMemory
from kvxferd.dataplane.plan import build_plan, window_pieces
from kvxferd.dataplane.remap import Side, plan_remap, remap


def move(src: Pool, src_ids: list[int], dst: Pool, dst_ids: list[int], chunk_bytes: int = 1000) -> int:
    """Plan both sides separately (as two daemons do) and move the stream chunk by chunk."""
    s_plan = plan_remap(src.side(src_ids), dst.side(dst_ids), chunk_bytes, "src")
    d_plan = plan_remap(src.side(src_ids), dst.side(dst_ids), chunk_bytes, "dst")
    assert s_plan.total_bytes == d_plan.total_bytes and len(s_plan.chunks) == len(d_plan.chunks)
    here, there = MappedMemory(src.buffers), MappedMemory(dst.buffers)
    for sc, dc in zip(s_plan.chunks, d_plan.chunks, strict=True):
        assert sc.nbytes == dc.nbytes
        staged = np.empty(sc.nbytes, dtype=np.uint8)
        here.gather(sc, staged)
        there.scatter(dc, staged)
    return s_plan.total_bytes


CASES = [
    # (total KV heads, prefill TP, decode TP, prefill order, decode order, prefill block, decode block)
    (8, 1, 1, "HND", "HND", 16, 16),
    (8, 1, 2, "HND", "HND", 16, 16),
    (8, 1, 4, "NHD", "NHD", 16, 16),
    (8, 2, 1, "HND", "HND", 16, 16),
    (8, 4, 2, "NHD", "HND", 16, 16),
    (4, 8, 8, "HND", "HND", 16, 16),  # more ranks than heads: pairs of ranks share a head
    (4, 2, 8, "HND", "NHD", 16, 16),
    (8, 1, 1, "NHD", "HND", 16, 16),
    (8, 1, 1, "HND", "NHD", 16, 16),
    (8, 1, 1, "HND", "HND", 16, 32),
    (8, 1, 1, "HND", "HND", 32, 16),
    (8, 2, 4, "NHD", "NHD", 32, 16),
    (8, 1, 2, "NHD", "HND", 16, 64),
    (1, 1, 2, "HND", "HND", 16, 16),  # MLA: one latent "head", every rank takes it whole
]


@pytest.mark.parametrize("tokens", [40, 64])
@pytest.mark.parametrize(("heads", "p_tp", "d_tp", "p_order", "d_order", "p_block", "d_block"), CASES)
def test_every_mapping_lands_each_element_where_the_reference_says(
    heads: int, p_tp: int, d_tp: int, p_order: str, d_order: str, p_block: int, d_block: int, tokens: int
) -> None:
    logical = logical_kv(heads, tokens, seed=heads * 100 + p_tp * 10 + d_tp)
    rng = np.random.default_rng(tokens)
    p_ids = rng.permutation(POOL_BLOCKS)[: -(-tokens // p_block)].tolist()
    prefill = []
    for rank in range(p_tp):
        pool = Pool.empty(rank_heads(heads, p_tp, rank), p_block, p_order)
        pool.fill(logical, p_ids)
        prefill.append(pool)
    moved_from = [0] * p_tp
    for d_rank in range(d_tp):
        dst = Pool.empty(rank_heads(heads, d_tp, d_rank), d_block, d_order)
        d_ids = rng.permutation(POOL_BLOCKS)[: -(-tokens // d_block)].tolist()
        for source in head_sources(heads, p_tp, d_tp, d_rank):
            move(prefill[source.tp_rank], p_ids, dst, d_ids)
            moved_from[source.tp_rank] += 1
        # The destination holds exactly the request's tokens of its heads, nothing else written.
        expected = dst.expected(logical, d_ids, dst.heads, tokens)
        for got, want in zip(dst.buffers, expected, strict=True):
            np.testing.assert_array_equal(got, want)
    assert moved_from == [readers(heads, p_tp, d_tp, r) for r in range(p_tp)]


@pytest.mark.parametrize(("heads", "p_tp", "d_tp", "p_order", "d_order", "p_block", "d_block"), CASES)
def test_both_sides_sum_a_remapped_stream_alike_window_by_window(
    heads: int, p_tp: int, d_tp: int, p_order: str, d_order: str, p_block: int, d_block: int
) -> None:
    """The landing check of a remapped pull: each side sums windows of the stream through its
    own plan (windows of 512 bytes straddle the 1000-byte chunks); after the move every window
    agrees, and one byte changed where the stream landed changes its window's sum only."""
    logical = logical_kv(heads, 64, seed=7)
    src = Pool.empty(rank_heads(heads, p_tp, 0), p_block, p_order)
    dst = Pool.empty(rank_heads(heads, d_tp, 0), d_block, d_order)
    p_ids, d_ids = list(range(64 // p_block)), list(range(64 // d_block))[::-1]
    src.fill(logical, p_ids)
    total = move(src, p_ids, dst, d_ids)
    s_plan = plan_remap(src.side(p_ids), dst.side(d_ids), 1000, "src")
    d_plan = plan_remap(src.side(p_ids), dst.side(d_ids), 1000, "dst")
    windows = np.arange(-(-total // 512))
    sent = window_sums(MappedMemory(src.buffers), s_plan, 512, windows)
    np.testing.assert_array_equal(sent, window_sums(MappedMemory(dst.buffers), d_plan, 512, windows))
    k = len(windows) // 2
    buf, off, _ = window_pieces(d_plan, k * 512, (k + 1) * 512)
    dst.buffers[int(buf[0])][int(off[0])] ^= 0x10
    changed = sent != window_sums(MappedMemory(dst.buffers), d_plan, 512, windows)
    assert np.flatnonzero(changed).tolist() == [k]


def test_the_same_geometry_on_both_sides_plans_what_build_plan_plans() -> None:
    pool = Pool.empty(HeadRange(0, 4), 16, "HND")
    ids = [5, 2, 9]
    s, d = remap(pool.side(ids), pool.side([1, 7, 3]))
    classic = build_plan(pool.regions(), np.array(ids), 1 << 20)
    assert len(s.offset) == classic.num_segments == LAYERS * 2 * 3
    assert s.nbytes.tolist() == [pool.block_bytes] * len(s.nbytes) and len(d.offset) == len(s.offset)


def test_head_sliced_heads_major_blocks_stay_one_segment_per_block_and_region() -> None:
    src = Pool.empty(HeadRange(0, 8), 16, "HND")
    dst = Pool.empty(HeadRange(4, 4), 16, "HND")
    s, d = remap(src.side([0, 2, 4]), dst.side([3, 4, 5]))
    assert len(s.offset) == LAYERS * 2 * 3  # heads 4..7 are one run in each source block
    assert set(s.nbytes.tolist()) == {dst.block_bytes}
    assert len(d.offset) == LAYERS * 2  # consecutive destination blocks merge into one run


def test_what_cannot_be_mapped_is_refused_with_the_reason() -> None:
    a = Pool.empty(HeadRange(0, 4), 16, "HND")
    with pytest.raises(IncompatibleError, match="none shared"):
        remap(a.side([0]), Pool.empty(HeadRange(4, 4), 16, "HND").side([0]))
    with pytest.raises(IncompatibleError, match="one must divide the other"):
        remap(a.side([0, 1, 2]), Pool.empty(HeadRange(0, 4), 24, "HND").side([0, 1]))
    with pytest.raises(InvalidRequestError, match="blocks go unused"):
        remap(a.side([0, 1]), Pool.empty(HeadRange(0, 4), 16, "HND").side([0, 1, 2]))
    narrow = Side(a.regions(), np.array([0]), 16, HeadRange(0, 4), HEAD_BYTES * 2, "HND")
    with pytest.raises(IncompatibleError, match="head size differs"):
        remap(a.side([0]), narrow)
