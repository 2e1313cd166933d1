"""Reads segment to segment (same-host direct reads of blocks laid out alike): the rows name
each segment in the stream order the chunk plans use, every byte lands where the plan would
put it, the copy threads share the rows by bytes, a share that fails stops the read typed
(after every thread stopped), and the windows folded into the read are summed as the pull's
check would sum them.

Real ``process_vm_readv``: this process reads itself, the way the decode daemon reads the
offering daemon.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvxfer.errors import UnavailableError
from kvxfer.proto import peer_pb2
from kvxferd._digest import sum_entries
from kvxferd._folded_sums import fold_windows
from kvxferd.dataplane.cma import self_copy_works
from kvxferd.dataplane.hostmem import MappedMemory, ProcessMemory
from kvxferd.dataplane.plan import RegionTable, build_plan
from kvxferd.dataplane.segment_reads import read_rows, segment_rows

pytestmark = pytest.mark.skipif(not self_copy_works(), reason="process_vm_readv on this process is refused here")

# Three regions over two buffers, 64 blocks: 1 KiB, 1 KiB and 2 KiB segments.
TABLE = RegionTable.from_regions([(0, 0, 4096, 1024), (0, 1024, 4096, 1024), (1, 0, 2048, 2048)])
BUFFER_BYTES = (64 * 4096, 64 * 2048)


def _pool(fill: int | None) -> list[np.ndarray]:
    rng = np.random.default_rng(fill)
    return [
        rng.integers(0, 256, n, dtype=np.uint8) if fill is not None else np.zeros(n, np.uint8) for n in BUFFER_BYTES
    ]


def _there(arrays: list[np.ndarray]) -> ProcessMemory:
    return ProcessMemory(os.getpid(), np.array([a.ctypes.data for a in arrays], dtype=np.int64), lambda: None)


def _stream(arrays: list[np.ndarray], ids: np.ndarray) -> bytes:
    """The blocks' bytes in stream order, by the chunk plan (one chunk holds them all)."""
    plan = build_plan(TABLE, ids, 1 << 30)
    out = np.empty(plan.total_bytes, dtype=np.uint8)
    MappedMemory(arrays).gather(plan.chunks[0], out)
    return out.tobytes()


def test_rows_name_every_segment_in_the_plans_stream_order() -> None:
    arrays = _pool(1)
    ids = np.array([9, 2, 40, 2 + 1], dtype=np.int64)
    rows = segment_rows([a.ctypes.data for a in arrays], TABLE, ids)
    assert rows.shape == (3 * 4, 2)
    assert rows[:, 1].tolist() == [1024] * 8 + [2048] * 4
    base = [a.ctypes.data for a in arrays]
    want = [base[b] + o + i * s for b, o, s in zip(TABLE.buffer, TABLE.offset, TABLE.stride, strict=True) for i in ids]
    assert rows[:, 0].tolist() == want


@pytest.mark.parametrize("blocks", [3, 60])  # 9 segments inline; 180 segments in two threads
async def test_a_read_lands_every_byte_where_the_plan_puts_it(blocks: int) -> None:
    src, dst = _pool(2), _pool(None)
    rng = np.random.default_rng(blocks)
    src_ids, dst_ids = rng.permutation(64)[:blocks], rng.permutation(64)[:blocks]
    remote = segment_rows([a.ctypes.data for a in src], TABLE, src_ids)
    local = segment_rows([a.ctypes.data for a in dst], TABLE, dst_ids)
    shares: list[tuple[int, int, int]] = []

    def landed(lo: int, hi: int) -> None:
        shares.append((lo, hi, threading.get_ident()))

    with ThreadPoolExecutor(2) as executor:
        await read_rows(executor, 2, _there(src), local, remote, landed)
    assert _stream(dst, dst_ids) == _stream(src, src_ids)
    # Shares of equal bytes: 120 segments of 1 KiB, then 60 of 2 KiB.
    assert sorted((lo, hi) for lo, hi, _ in shares) == ([(0, 9)] if blocks == 3 else [(0, 120), (120, 180)])
    untouched = np.setdiff1d(np.arange(64), dst_ids)
    assert _stream(dst, untouched) == bytes(len(untouched) * 4096)  # nothing else written


async def test_a_read_of_more_rows_than_one_call_takes_lands_too() -> None:
    """2,500 segments of 64 bytes: three calls of at most 1,024 rows in one thread's share."""
    table = RegionTable.from_regions([(0, 0, 64, 64)])
    src = np.random.default_rng(3).integers(0, 256, 4096 * 64, dtype=np.uint8)
    dst = np.zeros_like(src)
    ids = np.random.default_rng(4).permutation(4096)[:2500]
    remote, local = segment_rows([src.ctypes.data], table, ids), segment_rows([dst.ctypes.data], table, ids[::-1])
    with ThreadPoolExecutor(1) as executor:
        await read_rows(executor, 1, _there([src]), local, remote)  # 160,000 bytes: a thread's work
    np.testing.assert_array_equal(dst.reshape(-1, 64)[ids[::-1]], src.reshape(-1, 64)[ids])


async def test_a_share_that_cannot_read_fails_the_read_typed_once_every_thread_stopped() -> None:
    src, dst = _pool(5), _pool(None)
    ids = np.arange(60)
    remote = segment_rows([a.ctypes.data for a in src], TABLE, ids)
    local = segment_rows([a.ctypes.data for a in dst], TABLE, ids)
    remote[-1, 0] = 8  # an address nobody maps: the second share's call fails (EFAULT)
    folded_ran: list[int] = []
    with ThreadPoolExecutor(2) as executor:
        with pytest.raises(UnavailableError, match="cannot reach"):
            await read_rows(executor, 2, _there(src), local, remote, lambda lo, hi: folded_ran.append(lo))
        # Both shares have ended: nothing is left running in the executor's two threads.
        assert executor.submit(lambda: 1).result(timeout=5) == 1
    assert 120 not in folded_ran  # the failed share (rows 120..179) never said its rows landed


async def test_windows_folded_into_the_read_are_summed_as_the_check_sums_them() -> None:
    src, dst = _pool(6), _pool(None)
    src_ids, dst_ids = np.arange(60), np.arange(60)[::-1].copy()
    said = peer_pb2.BlockSums(
        mode="sampled",
        positions=[0, 59, 30, 7],
        regions=[0, 2, 1, 2],
        starts=[0, 1024, 512, 8],
        lengths=[1024, 1024, 256, 64],
        sums=[0, 0, 0, 0],
    )
    here = MappedMemory(dst)
    folded = fold_windows(said, here, TABLE, dst_ids)
    assert folded is not None
    remote = segment_rows([a.ctypes.data for a in src], TABLE, src_ids)
    local = segment_rows(here.bases, TABLE, dst_ids)
    with ThreadPoolExecutor(2) as executor:
        await read_rows(executor, 2, _there(src), local, remote, folded.landed)
    e = folded.expected
    assert e.regions is not None and e.within is not None
    want = sum_entries(here, TABLE, dst_ids[e.positions], e.regions, e.within)
    assert folded.sums.tolist() == want.tolist() and want.all()
    assert fold_windows(peer_pb2.BlockSums(mode="full", positions=[0], sums=[1]), here, TABLE, dst_ids) is None


def test_windows_outside_the_read_are_refused_before_any_byte_moves() -> None:
    said = peer_pb2.BlockSums(mode="sampled", positions=[0], regions=[0], starts=[1000], lengths=[100], sums=[0])
    with pytest.raises(Exception, match="outside this transfer"):
        fold_windows(said, MappedMemory(_pool(None)), TABLE, np.arange(4))
