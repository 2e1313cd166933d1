"""UCX sends and the chunk pipeline: a small chunk is sent in place (no task, no wait), a large
one is waited for; one-chunk and many-chunk plans land every byte, fragmented or contiguous;
a failed one-chunk move poisons its staging and says why.

Real UCX: one worker with an endpoint to itself (UCX's ``self`` transport), progressed by the
daemon's own driver, as in kvxferd.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kvxfer.errors import UnavailableError
from kvxferd.dataplane.hostcopy import contiguous_iov
from kvxferd.dataplane.hostmem import MappedMemory
from kvxferd.dataplane.pipeline import ChunkFlow, run_pipeline
from kvxferd.dataplane.plan import ChunkPlan, RegionTable, build_plan
from kvxferd.dataplane.staging import StagingPool
from kvxferd.dataplane.ucx import TagStream, UcxTransport

TAG = 5 << 24


@pytest.fixture
async def ucx() -> AsyncIterator[tuple[UcxTransport, Any]]:
    transport = UcxTransport()
    ep = await transport.endpoint("self", transport.worker_address, error_handling=False)
    yield transport, ep
    await transport.close()
    assert transport.progress is not None
    transport.progress.stop()


async def test_a_small_send_goes_out_in_place_and_a_large_one_is_waited_for(ucx: tuple[UcxTransport, Any]) -> None:
    transport, ep = ucx
    assert transport.iov is not None and transport.progress is not None
    for nbytes, in_place in ((4096, True), (1 << 20, False)):  # eager, then rendezvous (64 KiB up)
        src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
        dst = np.zeros(nbytes, dtype=np.uint8)
        with transport.progress.busy():
            sending = transport.iov.post_send_contig(ep.ucp_endpoint, src, TAG | 1, None)
            assert (sending is None) is in_place
            await transport.iov.recv(contiguous_iov(dst), TAG | 1, keep=dst)
            if sending is not None:
                await asyncio.wait_for(sending, 5)
        np.testing.assert_array_equal(dst, src)


@pytest.mark.parametrize(
    ("blocks", "chunk_bytes"),
    [([7], 1 << 20), ([3, 9, 1], 1 << 20), ([3, 9, 1, 12, 0], 8192), ([4, 5, 6], 1 << 20)],
    ids=["one-block", "one-fragmented-chunk", "many-chunks", "one-contiguous-chunk"],
)
async def test_a_plan_lands_every_byte_whatever_its_chunks(
    ucx: tuple[UcxTransport, Any], blocks: list[int], chunk_bytes: int
) -> None:
    transport, ep = ucx
    # Two regions of 2 KiB segments: a block is two pieces, a run of blocks two runs.
    regions = RegionTable.from_regions([(0, 0, 2048, 2048), (1, 0, 2048, 2048)])
    src = [np.random.default_rng(i).integers(0, 256, 16 * 2048, dtype=np.uint8) for i in range(2)]
    dst = [np.zeros(16 * 2048, dtype=np.uint8) for _ in range(2)]
    ids = np.array(blocks, dtype=np.int64)
    plan = build_plan(regions, ids, chunk_bytes)
    staging = StagingPool(4 * chunk_bytes, chunk_bytes)
    tag_base = (len(blocks) + chunk_bytes) << 24
    async with staging.lease(2) as sending, staging.lease(2) as landing:
        out = TagStream(ep, tag_base, ChunkFlow(plan, sending, 2))
        into = TagStream(ep, tag_base, ChunkFlow(build_plan(regions, ids, chunk_bytes), landing, 2))
        with ThreadPoolExecutor(1) as executor:
            await asyncio.wait_for(
                asyncio.gather(
                    transport.send(out, MappedMemory(src)), transport.receive(into, MappedMemory(dst), executor)
                ),
                10,
            )
    for region in range(2):
        for b in blocks:
            piece = slice(b * 2048, (b + 1) * 2048)
            np.testing.assert_array_equal(dst[region][piece], src[region][piece])
    assert len(transport.sends) == 0


async def test_a_one_chunk_move_that_fails_poisons_its_staging_and_says_why() -> None:
    regions = RegionTable.from_regions([(0, 0, 4096, 2048), (0, 2048, 4096, 2048)])
    plan = build_plan(regions, np.array([1, 0], dtype=np.int64), 1 << 20)
    assert len(plan.chunks) == 1 and plan.chunks[0].contiguous is None
    staging = StagingPool(1 << 20, 1 << 20)
    packed: list[Any] = []

    async def pack(chunk: ChunkPlan, staged: Any) -> None:
        packed.append(staged)

    async def move(chunk: ChunkPlan, staged: Any) -> None:
        raise ValueError("the wire broke")

    async with staging.lease(1) as lease:
        with pytest.raises(UnavailableError, match="the wire broke") as failed:
            await run_pipeline(ChunkFlow(plan, lease, 4), move, pack)
        assert lease.poisoned
        assert packed == [lease.buffers[0]]  # packed into staging before it moved
        assert isinstance(failed.value.__cause__, ValueError)


async def test_a_cancelled_one_chunk_move_is_cancelled_not_reported_as_a_failure() -> None:
    regions = RegionTable.from_regions([(0, 0, 4096, 4096)])
    plan = build_plan(regions, np.array([2], dtype=np.int64), 1 << 20)
    staging = StagingPool(1 << 20, 1 << 20)
    moving = asyncio.Event()

    async def move(chunk: ChunkPlan, staged: Any) -> None:
        assert staged is None  # contiguous in the pool: moved in place
        moving.set()
        await asyncio.sleep(60)

    async with staging.lease(1) as lease:
        task = asyncio.create_task(run_pipeline(ChunkFlow(plan, lease, 4), move))
        await moving.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert lease.poisoned  # UCX may still touch what the move had posted


@pytest.mark.parametrize("blocks", [[3], [5, 1, 9], list(range(40, 0, -3))], ids=["one", "three", "fourteen"])
def test_a_chunks_iov_rows_are_its_segments_in_stream_order(blocks: list[int]) -> None:
    # Two regions, blocks of 2 x 1 KiB: a few rows are listed in Python, many go through numpy.
    regions = RegionTable.from_regions([(0, 0, 1024, 1024), (1, 512, 2048, 1024)])
    arrays = [np.zeros(64 * 2048, dtype=np.uint8) for _ in range(2)]
    plan = build_plan(regions, np.array(blocks, dtype=np.int64), 1 << 20)
    [chunk] = plan.chunks
    bases = [a.ctypes.data for a in arrays]
    expected = [(bases[0] + b * 1024, 1024) for b in blocks] + [(bases[1] + 512 + b * 2048, 1024) for b in blocks]
    rows = MappedMemory(arrays).iov(chunk)
    assert rows.dtype == np.uint64 and rows.shape == (2 * len(blocks), 2)
    assert [tuple(r) for r in rows.tolist()] == expected
