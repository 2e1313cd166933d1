"""The GPU data plane's piece tables move exactly the bytes of a handoff (checked on the CPU).

The CUDA kernel copies ``len[i]`` bytes from ``src[i] + src_bias`` to ``dst[i] + dst_bias``
for every piece. Here "memory" is one numpy array and addresses are offsets into it, so the
same tables can be applied with numpy and compared with the host data plane's result.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer_client._cuda import describe_cuda_tensor, format_uuid, is_cuda_tensor
from kvxfer_client._errors import InvalidRequestError
from kvxferd.dataplane.gpucopy import MAX_PIECE, PieceTable, cut, segment_addresses
from kvxferd.dataplane.plan import RegionTable, build_plan


def apply(memory: np.ndarray, src: np.ndarray, dst: np.ndarray, lens: np.ndarray, sb: int = 0, db: int = 0) -> None:
    """What one kernel launch does, piece by piece (test oracle only)."""
    for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist(), strict=True):
        memory[d + db : d + db + n] = memory[s + sb : s + sb + n]


def test_cut_splits_ranges_at_every_multiple_and_keeps_every_byte() -> None:
    rng = np.random.default_rng(0)
    start = rng.integers(0, 10_000, 200)
    length = rng.integers(1, 5_000, 200)
    owner, pstart, plen = cut(start, length, 1024)
    assert (plen > 0).all() and (plen <= 1024).all()
    assert np.array_equal(np.bincount(owner, weights=plen, minlength=200).astype(int), length)
    # no piece crosses a multiple of the step
    assert ((pstart // 1024) == ((pstart + plen - 1) // 1024)).all()


@pytest.mark.parametrize("block_bytes", [32 << 10, 1000, 3])
def test_local_pieces_copy_blocks_exactly_and_cap_piece_size(block_bytes: int) -> None:
    regions = RegionTable.from_regions([(0, 0, block_bytes, block_bytes), (1, 7, block_bytes, block_bytes)])
    blocks = 40
    memory = np.zeros(8 * blocks * block_bytes + 64, dtype=np.uint8)
    src_base = np.array([0, blocks * block_bytes + 16], dtype=np.int64)
    dst_base = src_base + 4 * blocks * block_bytes + 8
    rng = np.random.default_rng(1)
    memory[: dst_base[0]] = rng.integers(0, 256, int(dst_base[0]), dtype=np.uint8)
    src_ids, dst_ids = np.array([5, 2, 30, 7]), np.array([0, 39, 3, 11])
    a, b, n = PieceTable.local(
        segment_addresses(src_base, regions, src_ids), segment_addresses(dst_base, regions, dst_ids)
    )
    assert n.max() <= MAX_PIECE
    apply(memory, a, b, n)
    for r, (buf, off) in enumerate([(0, 0), (1, 7)]):
        for s, d in zip(src_ids, dst_ids, strict=True):
            src = memory[src_base[buf] + off + s * block_bytes :][:block_bytes]
            dst = memory[dst_base[buf] + off + d * block_bytes :][:block_bytes]
            assert np.array_equal(src, dst), (r, s, d)


def test_stream_pieces_pack_chunks_in_the_host_plans_order() -> None:
    """Gathering chunk c with the GPU tables gives the bytes the host plan puts in chunk c."""
    block_bytes, blocks, chunk = 24 << 10, 64, 100_000
    regions = RegionTable.from_regions([(0, 0, block_bytes, block_bytes), (0, blocks * block_bytes, block_bytes, 8192)])
    memory = np.random.default_rng(2).integers(0, 256, 2 * blocks * block_bytes + 4 * chunk, dtype=np.uint8)
    pool_end = 2 * blocks * block_bytes
    ids = np.array([9, 3, 60, 1, 2, 33])
    addr, pos, plen, first = PieceTable.stream(segment_addresses(np.array([0]), regions, ids), chunk)
    plan = build_plan(regions, ids, chunk)
    assert len(first) == len(plan.chunks) + 1
    assert ((pos // chunk) == ((pos + plen - 1) // chunk)).all(), "a piece crosses a chunk boundary"

    from kvxferd.dataplane.hostcopy import gather_chunk

    pool = memory[:pool_end]
    staging = pool_end  # staging lives right after the pool in the same "memory"
    for c in plan.chunks:
        f, last = int(first[c.index]), int(first[c.index + 1])
        apply(memory, addr[f:last], pos[f:last], plen[f:last], db=staging - c.index * chunk)
        expected = np.empty(chunk, dtype=np.uint8)
        gather_chunk([pool], c, expected)
        assert np.array_equal(memory[staging : staging + c.nbytes], expected[: c.nbytes]), c.index


def test_uuid_format_and_non_tensors_are_refused_clearly() -> None:
    assert format_uuid(bytes(16)) == "GPU-00000000-0000-0000-0000-000000000000"
    assert not is_cuda_tensor(np.zeros(4))
    with pytest.raises(InvalidRequestError, match="neither a HostBuffer nor a GPU tensor"):
        describe_cuda_tensor(np.zeros(4))
